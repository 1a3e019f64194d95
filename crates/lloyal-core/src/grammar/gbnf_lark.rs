//! GBNF translated to llguidance's Lark dialect, with GBNF's meaning kept exactly.
//!
//! GBNF matches characters; llguidance splits the input into lexemes (terminals) first, by
//! maximal munch over the lexemes its parser allows: `start: WORD "s"` with `WORD: /[a-z]+/`
//! never accepts "cats". A translation that merely maps rules to Lark would change which strings
//! a grammar accepts. So:
//!
//! 1. Rules that are regular (no recursion, no token references) and runs of regular items
//!    inside the other rules become lexemes (one regex each); everything else stays a rule. A
//!    grammar whose root is regular is one lexeme: llguidance's lexer is then the whole parser.
//! 2. Each lexeme is checked with byte automata (`regex_automata`): it must match no empty
//!    string; after a complete match it may not continue with a byte that can start what follows
//!    it; and no complete match of a lexeme allowed at the same place may be a prefix of it that
//!    continues with such a byte. Those are the cases where maximal munch would cut the input
//!    elsewhere than GBNF can ([`conflicts()`]).
//! 3. A lexeme that fails is refined, until none fails: a run becomes one lexeme per item, a
//!    regular rule or group becomes a rule, a repetition repeats in the parser, a literal splits
//!    into characters. Single characters never fail, so this ends; in the worst case the grammar
//!    is character by character (exact, and slower).
//!
//! Where a construct has no llguidance equivalent (a code point that is not a Unicode scalar
//! value, `!<text>`), [`to_lark`] says so and the grammar stays on llama.cpp's engine.

use std::collections::{HashMap, HashSet};

use super::gbnf_syntax::{Item, Syntax, TokenRef};
use conflicts::conflicts;

/// The longest lexeme regex written (regular rules are inlined where referenced).
const MAX_LEXEME_REGEX: usize = 4 << 20;

/// The deepest a regular rule's regex nests (rules inlined in rules, groups, repetitions): past
/// it the rule stays a rule. llguidance refuses a lexeme regex nested some 80 deep (a chain of
/// 82 rules each referring to the next).
const MAX_INLINE_DEPTH: usize = 32;

/// How to name a token reference for llguidance (`<[id]>`; text references resolved by the
/// model's tokenizer to exactly one token).
pub(crate) type ResolveToken<'a> = &'a dyn Fn(&str) -> Option<u32>;

/// The Lark text for `syntax` starting at rule `root`, or the construct that has none.
pub(crate) fn to_lark(syntax: &Syntax, root: &str, resolve: ResolveToken<'_>) -> Result<String, String> {
    if syntax.rule(root).is_none() {
        return Err(format!("the grammar has no rule named {root:?}"));
    }
    let regular = regular_rules(syntax);
    let mut plan = Plan::default();
    for _ in 0..10_000 {
        let cfg = Builder::new(syntax, &regular, &plan, resolve).build(root)?;
        let failing = conflicts(&cfg);
        if failing.is_empty() {
            return Ok(cfg.lark());
        }
        let before = plan.len();
        for l in failing {
            plan.refine(&cfg.lexemes[l].origin, &regular);
        }
        if plan.len() == before {
            return Err("a lexeme conflict that no refinement resolves".into());
        }
    }
    Err("the grammar needs too many refinements".into())
}

/// Rules whose language is regular: no token reference and no recursion through them.
fn regular_rules(syntax: &Syntax) -> HashSet<String> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Visiting,
        Regular,
        Not,
    }
    fn visit(name: &str, syntax: &Syntax, marks: &mut HashMap<String, Mark>) -> bool {
        match marks.get(name) {
            Some(Mark::Regular) => return true,
            Some(_) => return false, // recursion, or known not regular
            None => {}
        }
        marks.insert(name.to_string(), Mark::Visiting);
        let ok = syntax
            .rule(name)
            .is_some_and(|alts| alts.iter().flatten().all(|i| item_regular(i, syntax, marks)));
        marks.insert(name.to_string(), if ok { Mark::Regular } else { Mark::Not });
        ok
    }
    fn item_regular(item: &Item, syntax: &Syntax, marks: &mut HashMap<String, Mark>) -> bool {
        match item {
            Item::Literal(_) | Item::Class { .. } | Item::Any => true,
            Item::Token { .. } => false,
            Item::Rule(name) => visit(name, syntax, marks),
            Item::Group(alts) => alts.iter().flatten().all(|i| item_regular(i, syntax, marks)),
            Item::Repeat { item, .. } => item_regular(item, syntax, marks),
        }
    }
    let mut marks = HashMap::new();
    for (name, _) in &syntax.rules {
        visit(name, syntax, &mut marks);
    }
    let regular: HashSet<String> =
        marks.into_iter().filter(|(_, m)| *m == Mark::Regular).map(|(n, _)| n).collect();
    // How deep each regular rule's regex nests once its regular rules are inlined.
    fn rule_depth(
        name: &str,
        syntax: &Syntax,
        regular: &HashSet<String>,
        memo: &mut HashMap<String, usize>,
    ) -> usize {
        if let Some(&d) = memo.get(name) {
            return d;
        }
        let d = syntax.rule(name).map_or(0, |alts| {
            alts.iter().flatten().map(|i| item_depth(i, syntax, regular, memo)).max().unwrap_or(0)
        });
        memo.insert(name.to_string(), d);
        d
    }
    fn item_depth(
        item: &Item,
        syntax: &Syntax,
        regular: &HashSet<String>,
        memo: &mut HashMap<String, usize>,
    ) -> usize {
        match item {
            Item::Literal(_) | Item::Class { .. } | Item::Any | Item::Token { .. } => 0,
            Item::Rule(name) if regular.contains(name) => 1 + rule_depth(name, syntax, regular, memo),
            Item::Rule(_) => 0,
            Item::Group(alts) => {
                1 + alts.iter().flatten().map(|i| item_depth(i, syntax, regular, memo)).max().unwrap_or(0)
            }
            Item::Repeat { item, .. } => 1 + item_depth(item, syntax, regular, memo),
        }
    }
    let mut memo = HashMap::new();
    let deep: Vec<String> = regular
        .iter()
        .filter(|n| rule_depth(n, syntax, &regular, &mut memo) > MAX_INLINE_DEPTH)
        .cloned()
        .collect();
    regular.into_iter().filter(|n| !deep.contains(n)).collect()
}

/// Where lexemes are cut finer than the first translation (keys: an item's regex).
#[derive(Default)]
struct Plan {
    /// Regular rules translated as rules.
    rules: HashSet<String>,
    /// Runs of items translated one lexeme per item.
    split_runs: HashSet<String>,
    /// Groups and repetitions translated for the parser instead of one lexeme.
    open: HashSet<String>,
}

impl Plan {
    fn len(&self) -> usize {
        self.rules.len() + self.split_runs.len() + self.open.len()
    }

    /// Cut the lexeme made of `run` finer.
    fn refine(&mut self, run: &[Item], regular: &HashSet<String>) {
        if run.len() > 1 {
            self.split_runs.insert(run_regex(run));
            return;
        }
        match run.first() {
            Some(Item::Rule(name)) if regular.contains(name) => {
                self.rules.insert(name.clone());
            }
            Some(item @ (Item::Group(_) | Item::Repeat { .. })) => {
                self.open.insert(item_regex_key(item));
            }
            Some(item @ Item::Literal(chars)) if chars.len() > 1 => {
                self.open.insert(item_regex_key(item));
            }
            _ => {} // one character: nothing finer
        }
    }
}

/// An element of a translated rule.
#[derive(Debug, Clone)]
enum Elem {
    Lexeme(usize),
    /// llguidance's token syntax (`<[id]>`, `<[^id]>`).
    Token(String),
    Rule(usize),
    Group(Vec<Vec<Elem>>),
    Repeat(Box<Elem>, u64, Option<u64>),
}

/// A lexeme: the items it was made of and their regex.
struct Lexeme {
    origin: Vec<Item>,
    regex: String,
}

/// The translated grammar: rules over lexemes. Rule 0 is `start`.
struct Cfg {
    rules: Vec<(String, Vec<Vec<Elem>>)>,
    lexemes: Vec<Lexeme>,
}

struct Builder<'a> {
    syntax: &'a Syntax,
    regular: &'a HashSet<String>,
    plan: &'a Plan,
    resolve: ResolveToken<'a>,
    rules: Vec<(String, Vec<Vec<Elem>>)>,
    rule_ids: HashMap<String, usize>,
    lexemes: Vec<Lexeme>,
    lexeme_ids: HashMap<String, usize>,
}

impl<'a> Builder<'a> {
    fn new(
        syntax: &'a Syntax,
        regular: &'a HashSet<String>,
        plan: &'a Plan,
        resolve: ResolveToken<'a>,
    ) -> Self {
        Builder {
            syntax,
            regular,
            plan,
            resolve,
            rules: Vec::new(),
            rule_ids: HashMap::new(),
            lexemes: Vec::new(),
            lexeme_ids: HashMap::new(),
        }
    }

    fn build(mut self, root: &str) -> Result<Cfg, String> {
        self.rules.push(("start".into(), Vec::new()));
        let body = self.sequence(&[Item::Rule(root.to_string())])?;
        self.rules[0].1 = vec![body];
        Ok(Cfg { rules: self.rules, lexemes: self.lexemes })
    }

    /// Whether `item` goes into a lexeme as a whole (under the current plan).
    fn lexical(&self, item: &Item) -> bool {
        match item {
            Item::Literal(chars) => chars.len() <= 1 || !self.plan.open.contains(&item_regex_key(item)),
            Item::Class { .. } | Item::Any => true,
            Item::Token { .. } => false,
            Item::Rule(name) => self.regular.contains(name) && !self.plan.rules.contains(name),
            Item::Group(alts) => {
                !self.plan.open.contains(&item_regex_key(item))
                    && alts.iter().flatten().all(|i| self.lexical(i))
            }
            Item::Repeat { item: inner, .. } => {
                !self.plan.open.contains(&item_regex_key(item)) && self.lexical(inner)
            }
        }
    }

    fn sequence(&mut self, items: &[Item]) -> Result<Vec<Elem>, String> {
        let mut out = Vec::new();
        let mut run: Vec<Item> = Vec::new();
        for item in items {
            if self.lexical(item) {
                run.push(item.clone());
                continue;
            }
            self.flush(&mut run, &mut out)?;
            out.push(self.element(item)?);
        }
        self.flush(&mut run, &mut out)?;
        Ok(out)
    }

    /// The pending run as lexemes (one, or one per item when the plan splits it).
    fn flush(&mut self, run: &mut Vec<Item>, out: &mut Vec<Elem>) -> Result<(), String> {
        if run.is_empty() {
            return Ok(());
        }
        let items = std::mem::take(run);
        if items.len() > 1 && self.plan.split_runs.contains(&run_regex(&items)) {
            for item in items {
                out.push(self.lexeme(vec![item])?);
            }
        } else if !(items.len() == 1 && matches!(&items[0], Item::Literal(c) if c.is_empty())) {
            out.push(self.lexeme(items)?);
        }
        Ok(())
    }

    fn lexeme(&mut self, items: Vec<Item>) -> Result<Elem, String> {
        let regex = items.iter().map(|i| item_regex(i, self.syntax)).collect::<Result<String, String>>()?;
        if regex.len() > MAX_LEXEME_REGEX {
            return Err(format!(
                "a lexeme whose regex exceeds {MAX_LEXEME_REGEX} bytes (rules inlined into it)"
            ));
        }
        let id = match self.lexeme_ids.get(&regex) {
            Some(&id) => id,
            None => {
                self.lexemes.push(Lexeme { origin: items, regex: regex.clone() });
                self.lexeme_ids.insert(regex, self.lexemes.len() - 1);
                self.lexemes.len() - 1
            }
        };
        Ok(Elem::Lexeme(id))
    }

    /// An item that is not (wholly) lexical, for the parser.
    fn element(&mut self, item: &Item) -> Result<Elem, String> {
        match item {
            Item::Rule(name) => Ok(Elem::Rule(self.rule(name)?)),
            Item::Token { negated, token } => {
                let id = match token {
                    TokenRef::Id(id) => *id,
                    TokenRef::Text(text) => {
                        if *negated {
                            return Err(format!("the negated token reference !{text}"));
                        }
                        (self.resolve)(text).ok_or_else(|| format!("invalid token '{text}'"))?
                    }
                };
                Ok(Elem::Token(if *negated { format!("<[^{id}]>") } else { format!("<[{id}]>") }))
            }
            Item::Group(alts) => {
                Ok(Elem::Group(alts.iter().map(|a| self.sequence(a)).collect::<Result<_, _>>()?))
            }
            Item::Repeat { item: inner, min, max } => {
                let inner = self.sequence(std::slice::from_ref(inner))?;
                let elem = match <[Elem; 1]>::try_from(inner) {
                    Ok([one]) => one,
                    Err(many) => Elem::Group(vec![many]),
                };
                Ok(Elem::Repeat(Box::new(elem), *min, *max))
            }
            Item::Literal(chars) => {
                // One lexeme per character (a sequence would merge them back into one).
                let elems = chars
                    .iter()
                    .map(|&c| self.lexeme(vec![Item::Literal(vec![c])]))
                    .collect::<Result<_, _>>()?;
                Ok(Elem::Group(vec![elems]))
            }
            Item::Class { .. } | Item::Any => self.lexeme(vec![item.clone()]),
        }
    }

    fn rule(&mut self, name: &str) -> Result<usize, String> {
        if let Some(&id) = self.rule_ids.get(name) {
            return Ok(id);
        }
        let id = self.rules.len();
        self.rules.push((lark_rule_name(name, id), Vec::new()));
        self.rule_ids.insert(name.to_string(), id);
        let alts =
            self.syntax.rule(name).ok_or_else(|| format!("Undefined rule identifier '{name}'"))?.to_vec();
        let body = alts.iter().map(|a| self.sequence(a)).collect::<Result<Vec<_>, _>>()?;
        self.rules[id].1 = body;
        Ok(id)
    }
}

fn lark_rule_name(name: &str, id: usize) -> String {
    let clean: String =
        name.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '_' }).collect();
    format!("r{id}_{clean}")
}

// ---- regexes -------------------------------------------------------------------------------

/// The regex text of a code point (`\x{..}` unless an ASCII letter or digit).
fn escape(c: u32) -> Result<String, String> {
    let ch = char::from_u32(c)
        .ok_or_else(|| format!("the code point U+{c:04X}, which is not a Unicode scalar value"))?;
    Ok(if ch.is_ascii_alphanumeric() { ch.to_string() } else { format!("\\x{{{c:X}}}") })
}

fn run_regex(items: &[Item]) -> String {
    items.iter().map(item_regex_key).collect()
}

/// An item's regex as a key (a construct without a regex keys by its debug form).
fn item_regex_key(item: &Item) -> String {
    item_regex_shallow(item).unwrap_or_else(|_| format!("{item:?}"))
}

/// An item's regex with rule references left as names (a key: regexes of rules differ only
/// where their rules do).
fn item_regex_shallow(item: &Item) -> Result<String, String> {
    match item {
        Item::Rule(name) => Ok(format!("<{name}>")),
        other => regex_of(other, &|name| Ok(format!("<{name}>"))),
    }
}

/// The regex of a lexical item, rule references expanded.
fn item_regex(item: &Item, syntax: &Syntax) -> Result<String, String> {
    fn rule(syntax: &Syntax, name: &str) -> Result<String, String> {
        let alts = syntax.rule(name).ok_or_else(|| format!("Undefined rule identifier '{name}'"))?;
        alternatives(alts, &|n| rule(syntax, n))
    }
    regex_of(item, &|name| rule(syntax, name))
}

fn alternatives(alts: &[Vec<Item>], rule: &dyn Fn(&str) -> Result<String, String>) -> Result<String, String> {
    let parts = alts
        .iter()
        .map(|seq| seq.iter().map(|i| regex_of(i, rule)).collect::<Result<String, String>>())
        .collect::<Result<Vec<_>, _>>()?;
    Ok(format!("(?:{})", parts.join("|")))
}

fn regex_of(item: &Item, rule: &dyn Fn(&str) -> Result<String, String>) -> Result<String, String> {
    Ok(match item {
        Item::Literal(chars) if chars.is_empty() => "(?:)".into(),
        Item::Literal(chars) => chars.iter().map(|&c| escape(c)).collect::<Result<String, String>>()?,
        Item::Class { negated, ranges } if ranges.is_empty() => {
            if *negated {
                "(?s:.)".into()
            } else {
                "[^\\x{0}-\\x{10FFFF}]".into()
            }
        }
        Item::Class { negated, ranges } => {
            let mut s = String::from(if *negated { "[^" } else { "[" });
            for &(lo, hi) in ranges {
                s.push_str(&escape(lo)?);
                if hi != lo {
                    // A reversed range matches nothing in GBNF.
                    if hi < lo {
                        return Ok("[^\\x{0}-\\x{10FFFF}]".into());
                    }
                    s.push('-');
                    s.push_str(&escape(hi)?);
                }
            }
            s.push(']');
            s
        }
        Item::Any => "(?s:.)".into(),
        Item::Rule(name) => format!("(?:{})", rule(name)?),
        Item::Group(alts) => alternatives(alts, rule)?,
        Item::Repeat { item, min, max } => {
            let inner = regex_of(item, rule)?;
            let count = match (min, max) {
                (0, None) => "*".to_string(),
                (1, None) => "+".to_string(),
                (0, Some(1)) => "?".to_string(),
                (m, None) => format!("{{{m},}}"),
                (m, Some(n)) if m == n => format!("{{{m}}}"),
                (m, Some(n)) => format!("{{{m},{n}}}"),
            };
            format!("(?:{inner}){count}")
        }
        Item::Token { .. } => return Err("a token reference inside a lexeme".into()),
    })
}

impl Cfg {
    /// The grammar in llguidance's Lark dialect.
    fn lark(&self) -> String {
        let mut out = String::from("%llguidance {}\n");
        for (name, alts) in &self.rules {
            let body: Vec<String> = alts.iter().map(|a| self.seq(a)).collect();
            out.push_str(&format!("{name}: {}\n", body.join(" | ")));
        }
        for (i, l) in self.lexemes.iter().enumerate() {
            out.push_str(&format!("T{i}: /{}/\n", l.regex));
        }
        out
    }

    fn seq(&self, seq: &[Elem]) -> String {
        if seq.is_empty() {
            return "\"\"".into();
        }
        seq.iter().map(|e| self.elem(e)).collect::<Vec<_>>().join(" ")
    }

    fn elem(&self, e: &Elem) -> String {
        match e {
            Elem::Lexeme(l) => format!("T{l}"),
            Elem::Token(t) => t.clone(),
            Elem::Rule(r) => self.rules[*r].0.clone(),
            Elem::Group(alts) => {
                let body: Vec<String> = alts.iter().map(|a| self.seq(a)).collect();
                format!("({})", body.join(" | "))
            }
            Elem::Repeat(inner, min, max) => {
                let inner = self.elem(inner);
                match (min, max) {
                    (0, None) => format!("{inner}*"),
                    (1, None) => format!("{inner}+"),
                    (0, Some(1)) => format!("{inner}?"),
                    (m, None) => format!("{inner}{{{m},}}"),
                    (m, Some(n)) if m == n => format!("{inner}{{{m}}}"),
                    (m, Some(n)) => format!("{inner}{{{m},{n}}}"),
                }
            }
        }
    }
}

mod conflicts;
#[cfg(test)]
mod tests;
