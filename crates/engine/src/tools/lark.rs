//! Pieces of llguidance's lark syntax the tool grammars are written with.

use serde_json::Value;

use crate::structured::regex_escape;

/// `s` as a lark string literal.
pub(super) fn lit(s: &str) -> String {
    Value::from(s).to_string()
}

/// `s` as text inside a lark `/regex/`.
pub(super) fn rx(s: &str) -> String {
    regex_escape(s)
        .replace('/', "\\/")
        .replace('\n', "\\n")
        .replace('\r', "\\r")
        .replace('\t', "\\t")
}

/// A negated lark regex: text that contains none of `forbidden` (to intersect with `&`).
pub(super) fn without(forbidden: &[&str]) -> String {
    let alts: Vec<String> = forbidden.iter().map(|f| rx(f)).collect();
    format!("~/(?s:.*)({})(?s:.*)/", alts.join("|"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_and_regexes() {
        assert_eq!(lit("a\"b\n"), "\"a\\\"b\\n\"");
        assert_eq!(rx("</x>[y]\n"), "<\\/x>\\[y\\]\\n");
        assert_eq!(without(&["<a>", "b"]), "~/(?s:.*)(<a>|b)(?s:.*)/");
    }
}
