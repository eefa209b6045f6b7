//! The nesting limit: a document whose collections nest deeper than [`MAX_NESTING`] is reported before the YAML
//! parser sees it, found by one pass over its text.

/// Collections nested deeper than this are reported before the YAML parser sees them: a real manifest nests about
/// ten levels, and the parser spends time quadratic in the depth of flow collections (`{a: {a: ...` 50,000 deep took
/// 43 s) before its own recursion limit (128) applies.
pub const MAX_NESTING: usize = 100;

pub(super) fn too_deep(line: usize) -> String {
    format!(
        "collections nested more than {MAX_NESTING} levels deep (at line {line}); the document is not parsed"
    )
}

/// The first line (1-based, of `text`) at which collections nest more than `limit` levels deep, found in one pass:
/// block levels (indentation, `- ` entries) plus flow levels (`[`, `{`), outside quoted scalars, comments and block
/// scalars, which it finds where YAML's rules let them begin (a quote opens a quoted scalar only where a node may
/// start, not inside or on the continuation line of a plain scalar). Where it is unsure it counts a level (a bracket
/// in a plain scalar does), so a document it passes does not nest deeper than `limit` for the parser.
pub(super) fn nesting_exceeds(text: &str, limit: usize) -> Option<usize> {
    let mut scan = Scan { limit, ..Scan::default() };
    text.lines().position(|line| scan.too_deep_at(line)).map(|number| number + 1)
}

/// What the scan carries from one line to the next.
#[derive(Default)]
struct Scan {
    limit: usize,
    /// Block levels, by indentation column.
    indents: Vec<usize>,
    block_depth: usize,
    flow: usize,
    quote: Option<u8>,
    /// Lines more indented than this column (and blank ones) are a block scalar's content.
    block_scalar: Option<usize>,
    /// A plain scalar ran to the end of a line of this indentation: a more indented line continues it.
    plain_from: Option<usize>,
}

/// Where the scan of one line is.
struct Cursor {
    at: usize,
    /// Where a node may begin: a quote there opens a quoted scalar, `|` or `>` a block scalar.
    node_start: bool,
    in_plain: bool,
    /// The column of the collection a block scalar begun on this line would belong to.
    scalar_parent: usize,
    line_plain_from: usize,
    /// The column the current block node starts at (a key, for `key: |`).
    node_column: usize,
    key_counted: bool,
}

impl Cursor {
    /// After an indicator, a separator or an opening bracket: a node may begin next.
    fn expect_node(&mut self) {
        self.node_start = true;
        self.in_plain = false;
    }

    /// After a closing bracket or the end of an alias: no node begins until a separator.
    fn end_node(&mut self) {
        self.node_start = false;
        self.in_plain = false;
    }
}

/// How the scan of a line goes on after a byte.
enum Step {
    Next,
    /// The rest of the line is a comment or a block scalar's header.
    EndOfLine,
    TooDeep,
}

/// How a line starts, outside quotes and flow collections.
enum LineStart {
    /// Blank, or a comment: nothing on it counts.
    Skip,
    TooDeep,
    Scan,
}

fn is_space(b: Option<&u8>) -> bool {
    b.is_none_or(|b| *b == b' ' || *b == b'\t')
}

/// The last byte of the anchor, tag or alias name that starts at `at`.
fn name_end(bytes: &[u8], mut at: usize) -> usize {
    while at + 1 < bytes.len() && !matches!(bytes[at + 1], b' ' | b'\t' | b',' | b'[' | b']' | b'{' | b'}') {
        at += 1;
    }
    at
}

impl Scan {
    /// Scans one line; true when collections nest deeper than the limit on it.
    fn too_deep_at(&mut self, line: &str) -> bool {
        let bytes = line.as_bytes();
        let indent = bytes.iter().take_while(|&&b| b == b' ').count();
        let blank = bytes[indent..].iter().all(u8::is_ascii_whitespace);
        if let Some(parent) = self.block_scalar {
            if blank || indent > parent {
                return false;
            }
            self.block_scalar = None;
        }
        let mut cursor = Cursor {
            at: 0,
            node_start: true,
            in_plain: false,
            scalar_parent: indent,
            line_plain_from: indent,
            node_column: 0,
            key_counted: false,
        };
        if self.quote.is_none() && self.flow == 0 {
            match self.line_start(bytes, indent, blank, &mut cursor) {
                LineStart::Skip => return false,
                LineStart::TooDeep => return true,
                LineStart::Scan => {}
            }
        }
        cursor.node_column = cursor.at;
        while cursor.at < bytes.len() {
            let step = match self.quote {
                Some(quote) => self.quoted_byte(quote, bytes, &mut cursor),
                None => self.unquoted_byte(line, &mut cursor),
            };
            match step {
                Step::Next => cursor.at += 1,
                Step::EndOfLine => break,
                Step::TooDeep => return true,
            }
        }
        self.plain_from =
            (cursor.in_plain && self.quote.is_none() && self.flow == 0).then_some(cursor.line_plain_from);
        false
    }

    /// The block levels a line opens by its indentation and its entry indicators, unless it continues a plain
    /// scalar.
    fn line_start(&mut self, bytes: &[u8], indent: usize, blank: bool, cursor: &mut Cursor) -> LineStart {
        if blank {
            return LineStart::Skip;
        }
        if bytes[indent] == b'#' {
            self.plain_from = None;
            return LineStart::Skip;
        }
        match self.plain_from {
            Some(from) if indent > from => {
                cursor.node_start = false;
                cursor.in_plain = true;
                cursor.line_plain_from = from;
            }
            _ => {
                while self.indents.last().is_some_and(|&top| top >= indent) {
                    self.indents.pop();
                }
                // The collections this line is inside of; its own (a sequence entry, a mapping key) count below.
                self.block_depth = self.indents.len();
                self.indents.push(indent);
                cursor.at = indent;
                // `- - - x`: each entry indicator opens a level on the same line.
                while matches!(bytes.get(cursor.at), Some(b'-' | b'?')) && is_space(bytes.get(cursor.at + 1))
                {
                    self.block_depth += 1;
                    cursor.scalar_parent = cursor.at;
                    cursor.at += 1;
                    while matches!(bytes.get(cursor.at), Some(b' ' | b'\t')) {
                        cursor.at += 1;
                    }
                }
                if self.block_depth > self.limit {
                    return LineStart::TooDeep;
                }
            }
        }
        LineStart::Scan
    }

    /// A byte inside a quoted scalar: only its closing quote (and, in double quotes, an escape) matters.
    fn quoted_byte(&mut self, quote: u8, bytes: &[u8], cursor: &mut Cursor) -> Step {
        let b = bytes[cursor.at];
        if quote == b'\'' {
            if b == b'\'' {
                if bytes.get(cursor.at + 1) == Some(&b'\'') {
                    cursor.at += 1;
                } else {
                    self.quote = None;
                    cursor.node_start = false;
                }
            }
        } else if b == b'\\' {
            cursor.at += 1;
        } else if b == b'"' {
            self.quote = None;
            cursor.node_start = false;
        }
        Step::Next
    }

    /// A byte outside quotes: brackets and indicators open levels, and where a node begins, quotes, anchors,
    /// tags, aliases and block scalars are recognised.
    fn unquoted_byte(&mut self, line: &str, cursor: &mut Cursor) -> Step {
        let bytes = line.as_bytes();
        let b = bytes[cursor.at];
        match b {
            b' ' | b'\t' => {}
            b'#' if cursor.at == 0 || matches!(bytes[cursor.at - 1], b' ' | b'\t') => {
                cursor.in_plain = false;
                return Step::EndOfLine;
            }
            b'\'' | b'"' if cursor.node_start => {
                self.quote = Some(b);
                cursor.in_plain = false;
            }
            // An anchor or a tag comes before the node it names.
            b'&' | b'!' if cursor.node_start => cursor.at = name_end(bytes, cursor.at),
            b'*' if cursor.node_start => {
                cursor.end_node();
                cursor.at = name_end(bytes, cursor.at);
            }
            b'[' | b'{' => {
                self.flow += 1;
                if self.block_depth + self.flow > self.limit {
                    return Step::TooDeep;
                }
                cursor.expect_node();
            }
            b']' | b'}' => {
                self.flow = self.flow.saturating_sub(1);
                cursor.end_node();
            }
            b',' if self.flow > 0 => cursor.expect_node(),
            b':' | b'-' | b'?' if is_space(bytes.get(cursor.at + 1)) => return self.indicator(b, cursor),
            b'|' | b'>' if cursor.node_start && self.flow == 0 => {
                return self.block_scalar_header(line, cursor);
            }
            _ => {
                if cursor.node_start && !cursor.in_plain {
                    cursor.node_column = cursor.at;
                }
                cursor.node_start = false;
                cursor.in_plain = true;
            }
        }
        Step::Next
    }

    /// `:`, `-` or `?` followed by a space; a block mapping's first key on a line opens a level.
    fn indicator(&mut self, b: u8, cursor: &mut Cursor) -> Step {
        if b == b':' && self.flow == 0 {
            cursor.scalar_parent = cursor.node_column;
            if !cursor.key_counted {
                cursor.key_counted = true;
                self.block_depth += 1;
                if self.block_depth > self.limit {
                    return Step::TooDeep;
                }
            }
        }
        cursor.expect_node();
        Step::Next
    }

    /// `|` or `>` where a node begins: a block scalar when the rest is a header (chomping and indentation
    /// indicators, a comment), else the start of a plain scalar.
    fn block_scalar_header(&mut self, line: &str, cursor: &mut Cursor) -> Step {
        let header = &line[cursor.at + 1..];
        let header = header.split_once(" #").map_or(header, |(h, _)| h).trim_end();
        if header.bytes().all(|b| b == b'+' || b == b'-' || b.is_ascii_digit()) {
            self.block_scalar = Some(cursor.scalar_parent);
            cursor.in_plain = false;
            return Step::EndOfLine;
        }
        cursor.node_start = false;
        cursor.in_plain = true;
        Step::Next
    }
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::path::Path;

    use super::super::test_support::{KUBE_DNS, KUBE_DNS_SLICE, names};
    use super::super::{load_path, parse_str};
    use super::*;

    /// A 200 KB document nested 100,000 levels (and a mapping nested 50,000 levels, whose parse alone takes
    /// the YAML parser 43 s) is rejected before the parser sees it, naming the document and line; the other
    /// documents of the file still load.
    #[test]
    fn deep_nesting_is_rejected_before_parsing() {
        let seq = "[".repeat(100_000) + &"]".repeat(100_000);
        let map = "{a: ".repeat(50_000) + "1" + &"}".repeat(50_000);
        let text = format!("{KUBE_DNS}---\n{seq}\n---\nkind: List\napiVersion: v1\nitems:\n- {map}\n");
        let started = std::time::Instant::now();
        let objects = parse_str(&text, "deep.yaml");
        assert!(started.elapsed() < std::time::Duration::from_secs(2), "{:?}", started.elapsed());
        assert_eq!(names(&objects), ["Service kube-system/kube-dns"]);
        let errors: Vec<String> = objects.errors.iter().map(ToString::to_string).collect();
        let seq_line = KUBE_DNS.lines().count() + 2;
        assert_eq!(
            errors,
            [
                format!(
                    "deep.yaml (document 2): collections nested more than 100 levels deep (at line {seq_line}); the document is not parsed"
                ),
                format!(
                    "deep.yaml (document 3): collections nested more than 100 levels deep (at line {}); the document is not parsed",
                    seq_line + 5
                ),
            ]
        );
        // JSON the same (serde_json has its own limit, but YAML would be tried next).
        let objects = parse_str(&seq, "deep.json");
        assert_eq!(objects.errors.len(), 1);
        assert!(
            objects.errors[0].message.starts_with("collections nested more than 100"),
            "{:?}",
            objects.errors
        );
        let objects = parse_str(&seq, "deep.txt");
        assert!(
            objects.errors[0].message.starts_with("collections nested more than 100"),
            "{:?}",
            objects.errors
        );
    }

    #[test]
    fn the_nesting_scan_counts_what_the_parser_would_see() {
        let deep = |open: &str, close: &str, n: usize| open.repeat(n) + &close.repeat(n);
        // At the limit, every way of nesting passes; one more level is found.
        for (text, depth) in [
            (deep("[", "]", 100), 100),
            (deep("{a: ", "}", 99) + "", 99),
            (format!("a:\n{}", (1..100).map(|i| format!("{}b:\n", " ".repeat(i))).collect::<String>()), 100),
            (format!("{}x\n", "- ".repeat(100)), 100),
            (format!("a:\n  b: {}", deep("[", "]", 98)), 100),
        ] {
            assert_eq!(nesting_exceeds(&text, depth), None, "{text:.80}");
            assert!(nesting_exceeds(&text, depth - 1).is_some(), "{text:.80}");
        }
        // Brackets that are text are not levels; quotes that are text hide nothing.
        let deep_flow = deep("[", "]", 200);
        for (text, counted) in [
            (format!("a: '{deep_flow}'\n"), false),
            (format!("a: \"{}\"\n", deep_flow.replace('[', "[\\\"")), false),
            (format!("a: 'it''s {deep_flow}'\n"), false),
            (format!("a: x # {deep_flow}\n"), false),
            (format!("a: |\n  {deep_flow}\n  'unclosed\nb: 1\n"), false),
            (format!("- key: >-\n   {deep_flow}\n"), false),
            // A quote inside a plain scalar, or on its continuation line, opens nothing.
            (format!("a: don 't\nb: {deep_flow}\n"), true),
            (format!("a: some text\n  'continued\nb: {deep_flow}\n"), true),
            (format!("a: &anchor x 'y\nb: {deep_flow}\n"), true),
            // ... but one where a node begins does, even an unclosed one (the parser reads to its end, too).
            (format!("a: &anchor 'x\nb: {deep_flow}\n"), false),
            // Closing brackets inside quoted scalars do not close levels.
            (format!("a: {}", "[ ']' ".repeat(150)), true),
            // A block scalar ends at a line no more indented than its key.
            (format!("- key: |\n  {deep_flow}\n"), true),
            (format!("a: b[\n{deep_flow}\n"), true),
        ] {
            assert_eq!(nesting_exceeds(&text, MAX_NESTING).is_some(), counted, "{text:.120}");
        }
        // Real manifests are nowhere near.
        let annotated = KUBE_DNS.replace(
            "  labels:\n",
            "  annotations:\n    kubectl.kubernetes.io/last-applied-configuration: |\n      {\"apiVersion\":\"v1\",\"kind\":\"Service\",\"metadata\":{\"annotations\":{},\"name\":\"kube-dns\"},\"spec\":{\"ports\":[{\"port\":53}]}}\n  labels:\n",
        );
        for text in [KUBE_DNS, KUBE_DNS_SLICE, &annotated] {
            assert_eq!(nesting_exceeds(text, 12), None, "{text}");
        }
        for entry in
            fs::read_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")).unwrap().flatten()
        {
            let objects = load_path(&entry.path());
            assert!(objects.errors.is_empty(), "{}: {:?}", entry.path().display(), objects.errors);
        }
    }
}
