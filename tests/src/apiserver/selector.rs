//! Label and field selectors, with the API server's syntax and semantics.

use serde_json::Value;

#[derive(Debug, PartialEq)]
enum Requirement {
    Exists(String),
    NotExists(String),
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

/// A parsed `labelSelector`; the empty selector matches everything.
#[derive(Debug, Default, PartialEq)]
pub(super) struct LabelSelector(Vec<Requirement>);

impl LabelSelector {
    /// Parses `k`, `!k`, `k=v`, `k==v`, `k!=v`, `k in (a,b)`, `k notin (a,b)`, comma-separated.
    pub fn parse(text: &str) -> Result<LabelSelector, String> {
        if text.trim().is_empty() {
            return Ok(LabelSelector::default());
        }
        split_top_level(text)?.into_iter().map(parse_requirement).collect::<Result<_, _>>().map(LabelSelector)
    }

    pub fn matches(&self, object: &Value) -> bool {
        let labels = &object["metadata"]["labels"];
        let label = |key: &str| labels.get(key).and_then(Value::as_str);
        self.0.iter().all(|req| match req {
            Requirement::Exists(k) => label(k).is_some(),
            Requirement::NotExists(k) => label(k).is_none(),
            Requirement::Equals(k, v) => label(k) == Some(v),
            Requirement::NotEquals(k, v) => label(k) != Some(v),
            Requirement::In(k, vs) => label(k).is_some_and(|l| vs.iter().any(|v| v == l)),
            Requirement::NotIn(k, vs) => label(k).is_none_or(|l| vs.iter().all(|v| v != l)),
        })
    }
}

/// Splits on commas outside parentheses.
fn split_top_level(text: &str) -> Result<Vec<&str>, String> {
    let mut terms = Vec::new();
    let (mut depth, mut start) = (0u32, 0);
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.checked_sub(1).ok_or_else(|| format!("unbalanced ')' in {text:?}"))?,
            ',' if depth == 0 => {
                terms.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(format!("unbalanced '(' in {text:?}"));
    }
    terms.push(&text[start..]);
    Ok(terms)
}

fn parse_requirement(term: &str) -> Result<Requirement, String> {
    let t = term.trim();
    let err = || format!("unable to parse requirement: {t:?}");
    if let Some(key) = t.strip_prefix('!') {
        return Ok(Requirement::NotExists(key_of(key.trim()).ok_or_else(err)?));
    }
    for (op, not) in [("!=", true), ("==", false), ("=", false)] {
        if let Some((k, v)) = t.split_once(op) {
            let (k, v) = (key_of(k.trim()).ok_or_else(err)?, value_of(v.trim()).ok_or_else(err)?);
            return Ok(if not { Requirement::NotEquals(k, v) } else { Requirement::Equals(k, v) });
        }
    }
    if let Some((head, rest)) = t.split_once('(') {
        let values = rest.strip_suffix(')').ok_or_else(err)?;
        let mut words = head.split_whitespace();
        let (Some(key), Some(op), None) = (words.next(), words.next(), words.next()) else {
            return Err(err());
        };
        let key = key_of(key).ok_or_else(err)?;
        let values: Vec<String> =
            values.split(',').map(|v| value_of(v.trim()).ok_or_else(err)).collect::<Result<_, _>>()?;
        return match op {
            "in" => Ok(Requirement::In(key, values)),
            "notin" => Ok(Requirement::NotIn(key, values)),
            _ => Err(err()),
        };
    }
    Ok(Requirement::Exists(key_of(t).ok_or_else(err)?))
}

/// A label key: `[prefix/]name` of alphanumerics, `-`, `_`, `.`.
fn key_of(key: &str) -> Option<String> {
    let ok = !key.is_empty()
        && key.chars().all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
        && key.split('/').all(|part| !part.is_empty())
        && key.matches('/').count() <= 1;
    ok.then(|| key.to_string())
}

/// A label value: empty, or alphanumerics, `-`, `_`, `.`.
fn value_of(value: &str) -> Option<String> {
    value.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)).then(|| value.to_string())
}

/// A parsed `fieldSelector` over `metadata.name` and `metadata.namespace`.
#[derive(Debug, Default, PartialEq)]
pub(super) struct FieldSelector(Vec<(&'static str, bool, String)>);

impl FieldSelector {
    /// Parses `field=v`, `field==v`, `field!=v`, comma-separated.
    pub fn parse(text: &str) -> Result<FieldSelector, String> {
        let mut terms = Vec::new();
        if text.trim().is_empty() {
            return Ok(FieldSelector(terms));
        }
        for term in text.split(',') {
            let term = term.trim();
            let (field, equal, value) = if let Some((f, v)) = term.split_once("!=") {
                (f, false, v)
            } else if let Some((f, v)) = term.split_once("==") {
                (f, true, v)
            } else if let Some((f, v)) = term.split_once('=') {
                (f, true, v)
            } else {
                return Err(format!("invalid selector: '{text}'; can't understand '{term}'"));
            };
            let field = match field.trim() {
                "metadata.name" => "name",
                "metadata.namespace" => "namespace",
                other => return Err(format!("field label not supported: {other}")),
            };
            terms.push((field, equal, value.trim().to_string()));
        }
        Ok(FieldSelector(terms))
    }

    pub fn matches(&self, object: &Value) -> bool {
        self.0.iter().all(|(field, equal, value)| {
            let actual = object["metadata"][*field].as_str().unwrap_or_default();
            (actual == value) == *equal
        })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn label_selectors() {
        let obj = json!({"metadata": {"labels": {"app": "web", "tier": "front", "example.com/x": "1"}}});
        let m = |s: &str| LabelSelector::parse(s).unwrap().matches(&obj);
        for yes in [
            "",
            "app",
            "!missing",
            "app=web",
            "app==web",
            "app!=db",
            "missing!=db",
            "app in (db, web)",
            "app notin (db)",
            "missing notin (db)",
            "app=web,tier in (front,back),example.com/x=1",
            " app = web , !missing ",
        ] {
            assert!(m(yes), "{yes:?} should match");
        }
        for no in
            ["missing", "!app", "app=db", "app!=web", "app in (db)", "missing in (web)", "app notin (web,db)"]
        {
            assert!(!m(no), "{no:?} should not match");
        }
        for bad in ["app in (web", "a b", "=web", "app in web)", "app,,tier", "app=we b", "app within (x)"] {
            assert!(LabelSelector::parse(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn field_selectors() {
        let obj = json!({"metadata": {"name": "a", "namespace": "ns1"}});
        let m = |s: &str| FieldSelector::parse(s).unwrap().matches(&obj);
        assert!(
            m("metadata.name=a") && m("metadata.name==a,metadata.namespace=ns1") && m("metadata.name!=b")
        );
        assert!(!m("metadata.name=b") && !m("metadata.namespace!=ns1"));
        assert!(FieldSelector::parse("spec.foo=1").unwrap_err().contains("field label not supported"));
        assert!(FieldSelector::parse("metadata.name").is_err());
    }
}
