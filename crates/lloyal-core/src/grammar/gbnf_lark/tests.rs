use std::collections::BTreeSet;

use super::conflicts::{prefix_continuations, Dfa};
use super::*;
use crate::grammar::gbnf_syntax::parse;

fn lark(gbnf: &str) -> Result<String, String> {
    let no_tokens = |_: &str| None;
    to_lark(&parse(gbnf).map_err(|e| format!("parse: {e}"))?, "root", &no_tokens)
}

/// The terminal definitions of a translation (`T<i>: /regex/` lines).
fn terminals(text: &str) -> Vec<String> {
    text.lines().filter(|l| l.starts_with('T')).map(str::to_string).collect()
}

#[test]
fn a_regular_grammar_is_one_lexeme() {
    let text = lark("root ::= en-char+ ([ \\t\\n] en-char+)*\nen-char ::= [a-zA-Z] | [0-9]\n").unwrap();
    assert_eq!(terminals(&text).len(), 1, "{text}");
    assert!(text.contains("start: T0"), "{text}");
}

#[test]
fn a_lexeme_that_would_swallow_what_follows_is_cut_finer() {
    // GBNF accepts "cats" (word "cat", then "s"); a lexeme [a-z]+ would take the "s" itself.
    let text = lark("root ::= word \"s\" tail\ntail ::= \"!\" | root\nword ::= [a-z]+\n").unwrap();
    assert!(!text.contains("T0: /(?:[a-z])+/"), "{text}");
    assert!(text.contains("/[a-z]/"), "the letters are single-character lexemes: {text}");
}

#[test]
fn trailing_space_before_a_newline_is_cut_but_a_safe_one_is_kept() {
    let arithmetic = "root ::= (expr \"=\" ws term \"\\n\")+\nexpr ::= term ([-+*/] term)*\n\
        term ::= ident | num | \"(\" ws expr \")\" ws\nident ::= [a-z] [a-z0-9_]* ws\nnum ::= [0-9]+ ws\n\
        ws ::= [ \\t\\n]*\n";
    let text = lark(arithmetic).unwrap();
    let ts = terminals(&text);
    // `ws` may be followed by "\n": one character at a time. The identifier's letters are safe.
    assert!(ts.iter().any(|t| t.ends_with(": /[\\x{20}\\x{9}\\x{A}]/")), "{text}");
    assert!(ts.iter().any(|t| t.ends_with(": /[a-z](?:[a-z0-9\\x{5F}])*/")), "{text}");
}

#[test]
fn a_json_string_stays_one_lexeme() {
    let json = "root ::= \"[\" ws (string (\",\" ws string)*)? \"]\" ws\n\
        string ::= \"\\\"\" [^\"\\\\]* \"\\\"\" ws\nws ::= | \" \" | \"\\n\" [ \\t]{0,20}\n";
    let text = lark(json).unwrap();
    assert!(
        terminals(&text).iter().any(|t| t.contains("[^\\x{22}\\x{5C}]") && t.contains("*\\x{22}")),
        "{text}"
    );
}

#[test]
fn competing_lexemes_are_cut_where_one_would_run_over_the_other() {
    // At the start both "a" (then y: "bd"...) and "abc" are possible, and y's recursion keeps "a"
    // a lexeme of its own: "abc" must not be one lexeme, or it would eat the "b" that y needs.
    let text = lark("root ::= x | \"abc\"\nx ::= \"a\" y\ny ::= \"bd\" | \"bd\" x\n").unwrap();
    assert!(terminals(&text).iter().any(|t| t.ends_with(": /a/")), "{text}");
    assert!(!terminals(&text).iter().any(|t| t.ends_with(": /abc/")), "{text}");
    // Merged into distinct lexemes ("abd" next to "abc"), nothing needs cutting.
    let merged = lark("root ::= x | \"abc\"\nx ::= \"a\" \"bd\" y\ny ::= \"!\" | x\n").unwrap();
    assert!(terminals(&merged).iter().any(|t| t.ends_with(": /abd/")), "{merged}");
}

#[test]
fn no_lexeme_matches_the_empty_string() {
    let text = lark("root ::= \"(\" ws body \")\"\nbody ::= ws | \"x\" body\nws ::= [ ]*\n").unwrap();
    for t in terminals(&text) {
        let regex = t.split_once(": /").map(|(_, r)| r.trim_end_matches('/')).unwrap_or_default();
        let dfa = Dfa::new(regex).unwrap();
        assert!(!dfa.accepts(dfa.start), "{t} matches the empty string");
    }
}

#[test]
fn tokens_are_llguidance_token_references() {
    let resolve = |t: &str| (t == "<eot>").then_some(7u32);
    let syntax = parse("root ::= \"a\" <[12]> !<[13]> <eot> x\nx ::= \"b\" | root\n").unwrap();
    let text = to_lark(&syntax, "root", &resolve).unwrap();
    assert!(text.contains("<[12]>") && text.contains("<[^13]>") && text.contains("<[7]>"), "{text}");
    let unknown = parse("root ::= <nope>\n").unwrap();
    assert!(to_lark(&unknown, "root", &resolve).unwrap_err().contains("invalid token"));
}

#[test]
fn constructs_without_an_llguidance_form_are_named() {
    let err = lark("root ::= \"\\uD800\"\n").unwrap_err();
    assert!(err.contains("U+D800") && err.contains("Unicode scalar"), "{err}");
    let no_tokens = |_: &str| None;
    let err =
        to_lark(&parse("root ::= !<foo> x\nx ::= \"a\" | root\n").unwrap(), "root", &no_tokens).unwrap_err();
    assert!(err.contains("negated token reference"), "{err}");
    assert!(lark("other ::= \"a\"\n").unwrap_err().contains("no rule named \"root\""));
}

#[test]
fn byte_automata_see_continuations_after_a_complete_match() {
    let word = Dfa::new("(?:[a-z])+").unwrap();
    let s = Dfa::new("s").unwrap();
    assert!(prefix_continuations(&word, &word).contains(&b's'), "a word goes on with a letter");
    assert!(prefix_continuations(&s, &s).is_empty(), "one character cannot go on");
    let a = Dfa::new("a").unwrap();
    let abc = Dfa::new("abc").unwrap();
    assert_eq!(prefix_continuations(&a, &abc), BTreeSet::from([b'b']));
    assert_eq!(word.first_bytes().len(), 26);
}
