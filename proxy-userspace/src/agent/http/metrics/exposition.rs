//! The text exposition format 0.0.4: the histogram and the writers of `HELP`, `TYPE` and sample lines, with
//! the format's escapes and float spellings. Knows no family; the families are in the sibling modules.

use std::fmt::Write as _;
use std::time::Duration;

/// `count` bucket bounds `start, start × factor, start × factor², …`, computed
/// the way Prometheus client libraries do (repeated multiplication).
pub fn exponential_buckets(start: f64, factor: f64, count: usize) -> Vec<f64> {
    let mut buckets = Vec::with_capacity(count);
    let mut bound = start;
    for _ in 0..count {
        buckets.push(bound);
        bound *= factor;
    }
    buckets
}

/// A Prometheus histogram: observations counted in buckets with inclusive
/// upper bounds (`le`), plus their sum and count. The implicit `+Inf` bucket
/// is the count.
#[derive(Clone, Debug, PartialEq)]
pub struct Histogram {
    bounds: Vec<f64>,
    /// Observations per bucket (not cumulative); `counts[i]` is for
    /// `bounds[i - 1] < v <= bounds[i]`.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// A histogram with these upper bounds. They are sorted, and NaN, infinite
    /// and duplicate bounds are dropped (`+Inf` is always implied).
    pub fn new(bounds: impl IntoIterator<Item = f64>) -> Self {
        let mut bounds: Vec<f64> = bounds.into_iter().filter(|b| b.is_finite()).collect();
        bounds.sort_by(f64::total_cmp);
        bounds.dedup();
        let counts = vec![0; bounds.len()];
        Histogram { bounds, counts, sum: 0.0, count: 0 }
    }

    /// Record one observation. NaN is counted only in `+Inf` (and makes the
    /// sum NaN), as Prometheus clients do.
    pub fn observe(&mut self, value: f64) {
        let index = self.bounds.partition_point(|bound| *bound < value);
        if let Some(slot) = self.counts.get_mut(index) {
            *slot += 1;
        }
        self.sum += value;
        self.count += 1;
    }

    /// Record a duration in seconds.
    pub fn observe_duration(&mut self, duration: Duration) {
        self.observe(duration.as_secs_f64());
    }

    /// The finite upper bounds.
    pub fn bounds(&self) -> &[f64] {
        &self.bounds
    }

    /// `(upper bound, observations <= bound)` for every bucket including the
    /// final `+Inf` one, as exposed on the wire.
    pub fn cumulative(&self) -> Vec<(f64, u64)> {
        let mut total = 0;
        let mut out: Vec<(f64, u64)> = self
            .bounds
            .iter()
            .zip(&self.counts)
            .map(|(bound, count)| {
                total += count;
                (*bound, total)
            })
            .collect();
        out.push((f64::INFINITY, self.count));
        out
    }

    /// Sum of all observations.
    pub fn sum(&self) -> f64 {
        self.sum
    }

    /// Number of observations.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Append the family (`HELP`, `TYPE`, `_bucket`, `_sum`, `_count`) to `out`.
    pub fn render(&self, name: &str, help: &str, out: &mut String) {
        self.render_labelled(name, help, &[], out);
    }

    /// As [`Histogram::render`], with `labels` on every series (before `le`, as
    /// client_golang writes them).
    pub fn render_labelled(&self, name: &str, help: &str, labels: &[(&str, &str)], out: &mut String) {
        header(out, name, help, "histogram");
        self.render_series(name, labels, out);
    }

    /// The series alone (`_bucket`, `_sum`, `_count` with `labels`), for a family whose header is
    /// written once before several label sets.
    pub fn render_series(&self, name: &str, labels: &[(&str, &str)], out: &mut String) {
        for (bound, count) in self.cumulative() {
            let le = format_float(bound);
            let bucket_labels: Vec<(&str, &str)> =
                labels.iter().copied().chain([("le", le.as_str())]).collect();
            let _ = writeln!(out, "{name}_bucket{} {count}", label_set(&bucket_labels));
        }
        let _ = writeln!(out, "{name}_sum{} {}", label_set(labels), format_float(self.sum));
        let _ = writeln!(out, "{name}_count{} {}", label_set(labels), self.count);
    }
}

pub(super) fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {name} {}", escape_help(help));
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

pub(super) fn scalar(out: &mut String, name: &str, help: &str, kind: &str, value: &str) {
    header(out, name, help, kind);
    sample(out, name, &[], value);
}

/// One unlabelled family per `(name, help, kind, value)`, in order.
pub(super) fn scalars<'a>(
    out: &mut String,
    families: impl IntoIterator<Item = (&'a str, &'a str, &'a str, String)>,
) {
    for (name, help, kind, value) in families {
        scalar(out, name, help, kind, &value);
    }
}

/// One series: `name{labels} value`.
pub(super) fn sample(out: &mut String, name: &str, labels: &[(&str, &str)], value: &str) {
    let _ = writeln!(out, "{name}{} {value}", label_set(labels));
}

/// `{k="v",k2="v2"}` with the values escaped, or nothing without labels.
fn label_set(labels: &[(&str, &str)]) -> String {
    if labels.is_empty() {
        return String::new();
    }
    let pairs: Vec<String> =
        labels.iter().map(|(key, value)| format!("{key}=\"{}\"", escape_label_value(value))).collect();
    format!("{{{}}}", pairs.join(","))
}

/// One family whose series differ in the one label `label`: `(label value, sample)` each.
pub(super) fn labelled<'a>(
    out: &mut String,
    name: &str,
    help: &str,
    kind: &str,
    label: &str,
    samples: impl Iterator<Item = (&'a String, u64)>,
) {
    header(out, name, help, kind);
    for (value, sample) in samples {
        let _ = writeln!(out, "{name}{{{label}=\"{}\"}} {sample}", escape_label_value(value));
    }
}

/// Escape a label value for the text format: `\` → `\\`, `"` → `\"`,
/// newline → `\n`.
pub fn escape_label_value(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// Escape `HELP` text: `\` → `\\`, newline → `\n`.
fn escape_help(help: &str) -> String {
    help.replace('\\', "\\\\").replace('\n', "\\n")
}

/// A sample value or `le` bound: shortest round-trip decimal, with the text
/// format's spellings of the non-finite values.
pub fn format_float(value: f64) -> String {
    if value.is_nan() {
        "NaN".to_owned()
    } else if value == f64::INFINITY {
        "+Inf".to_owned()
    } else if value == f64::NEG_INFINITY {
        "-Inf".to_owned()
    } else {
        format!("{value}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_bucket_math() {
        let mut h = Histogram::new([5.0, 1.0, 2.0, 2.0, f64::INFINITY, f64::NAN]);
        assert_eq!(h.bounds(), &[1.0, 2.0, 5.0]);
        for v in [0.5, 1.0, 1.5, 2.0, 4.0, 5.0, 7.0, 100.0] {
            h.observe(v);
        }
        assert_eq!(h.cumulative(), vec![(1.0, 2), (2.0, 4), (5.0, 6), (f64::INFINITY, 8)]);
        assert_eq!(h.count(), 8);
        assert_eq!(h.sum(), 121.0);

        h.observe_duration(Duration::from_millis(1500));
        assert_eq!(h.cumulative()[1], (2.0, 5));
        assert_eq!(h.sum(), 122.5);

        let empty = Histogram::new(Vec::new());
        assert_eq!(empty.cumulative(), vec![(f64::INFINITY, 0)]);
    }

    #[test]
    fn histogram_renders_cumulative_buckets() {
        let mut h = Histogram::new([0.1, 1.0]);
        h.observe(0.05);
        h.observe(0.5);
        h.observe(3.0);
        let mut out = String::new();
        h.render("x_seconds", "Some \\ help\nmore", &mut out);
        assert_eq!(
            out,
            "# HELP x_seconds Some \\\\ help\\nmore\n\
             # TYPE x_seconds histogram\n\
             x_seconds_bucket{le=\"0.1\"} 1\n\
             x_seconds_bucket{le=\"1\"} 2\n\
             x_seconds_bucket{le=\"+Inf\"} 3\n\
             x_seconds_sum 3.55\n\
             x_seconds_count 3\n"
        );
    }

    #[test]
    fn label_and_float_formatting() {
        assert_eq!(escape_label_value(r#"a"b\c"#), r#"a\"b\\c"#);
        assert_eq!(escape_label_value("x\ny"), "x\\ny");
        assert_eq!(format_float(1.0), "1");
        assert_eq!(format_float(0.25), "0.25");
        assert_eq!(format_float(f64::INFINITY), "+Inf");
        assert_eq!(format_float(f64::NEG_INFINITY), "-Inf");
        assert_eq!(format_float(f64::NAN), "NaN");
    }
}
