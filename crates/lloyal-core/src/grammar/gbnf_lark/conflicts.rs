//! Where llguidance's maximal-munch lexer could cut the input differently from GBNF: each
//! lexeme's byte automaton (`regex_automata`) checked against what may follow it and against the
//! lexemes allowed at the same place (the module docs of [`super`], point 2).

use std::collections::{BTreeSet, HashMap, HashSet};

use regex_automata::dfa::{dense, Automaton, StartKind};
use regex_automata::util::primitives::StateID;
use regex_automata::util::start;
use regex_automata::{Anchored, MatchKind};

use super::{Cfg, Elem};
use crate::grammar::gbnf_syntax::Item;

/// One lexeme's byte automaton, with the states from which a match is still reachable.
pub(super) struct Dfa {
    dfa: dense::DFA<Vec<u32>>,
    pub(super) start: StateID,
    /// States some continuation (maybe empty) of whose input is in the language. Not "not
    /// dead": the DFA reports a match one byte late, so the byte after a complete match leads
    /// to a live state whatever that byte is.
    viable: HashSet<StateID>,
}

/// Most states explored per lexeme automaton (beyond: the lexeme is cut finer).
const MAX_DFA_STATES: usize = 50_000;

impl Dfa {
    pub(super) fn new(regex: &str) -> Option<Dfa> {
        let dfa = dense::Builder::new()
            .configure(
                dense::Config::new()
                    .match_kind(MatchKind::All)
                    .start_kind(StartKind::Anchored)
                    .dfa_size_limit(Some(8 << 20))
                    .determinize_size_limit(Some(8 << 20)),
            )
            .build(regex)
            .ok()?;
        let start = dfa.start_state(&start::Config::new().anchored(Anchored::Yes)).ok()?;
        // Every reachable state and its predecessors, then back from the accepting ones.
        let mut preds: HashMap<StateID, Vec<StateID>> = HashMap::new();
        let mut seen = HashSet::from([start]);
        let mut todo = vec![start];
        while let Some(s) = todo.pop() {
            for b in 0..=255u8 {
                let n = dfa.next_state(s, b);
                if dfa.is_dead_state(n) || dfa.is_quit_state(n) {
                    continue;
                }
                preds.entry(n).or_default().push(s);
                if seen.insert(n) {
                    if seen.len() > MAX_DFA_STATES {
                        return None;
                    }
                    todo.push(n);
                }
            }
        }
        let accepts = |s: StateID| dfa.is_match_state(dfa.next_eoi_state(s));
        let mut viable: HashSet<StateID> = seen.iter().copied().filter(|&s| accepts(s)).collect();
        let mut todo: Vec<StateID> = viable.iter().copied().collect();
        while let Some(s) = todo.pop() {
            for &p in preds.get(&s).map(Vec::as_slice).unwrap_or_default() {
                if viable.insert(p) {
                    todo.push(p);
                }
            }
        }
        Some(Dfa { dfa, start, viable })
    }

    fn live(&self, s: StateID) -> bool {
        self.viable.contains(&s)
    }

    fn next(&self, s: StateID, b: u8) -> StateID {
        self.dfa.next_state(s, b)
    }

    /// Whether the input that led to `s` is a complete match.
    pub(super) fn accepts(&self, s: StateID) -> bool {
        self.dfa.is_match_state(self.dfa.next_eoi_state(s))
    }

    pub(super) fn first_bytes(&self) -> BTreeSet<u8> {
        (0..=255u8).filter(|&b| self.live(self.next(self.start, b))).collect()
    }
}

/// Bytes `b` such that a complete match `w` of `x` has `w b` as a prefix of a string of `y`.
pub(super) fn prefix_continuations(x: &Dfa, y: &Dfa) -> BTreeSet<u8> {
    let mut out = BTreeSet::new();
    let mut seen = HashSet::new();
    let mut stack = vec![(x.start, y.start)];
    while let Some((sx, sy)) = stack.pop() {
        if !seen.insert((sx, sy)) || seen.len() > 200_000 {
            continue;
        }
        let x_done = x.accepts(sx);
        for b in 0..=255u8 {
            let ny = y.next(sy, b);
            if !y.live(ny) {
                continue;
            }
            if x_done {
                out.insert(b);
            }
            let nx = x.next(sx, b);
            if x.live(nx) {
                stack.push((nx, ny));
            }
        }
    }
    out
}

/// The lexemes that maximal munch could cut differently from GBNF (see the module docs).
pub(super) fn conflicts(cfg: &Cfg) -> BTreeSet<usize> {
    let n = cfg.lexemes.len();
    if cfg.rules.len() == 1 && n == 1 {
        return BTreeSet::new(); // one lexeme for the whole grammar: no boundary to get wrong
    }
    let dfas: Vec<Option<Dfa>> = cfg.lexemes.iter().map(|l| Dfa::new(&l.regex)).collect();
    let mut failing = BTreeSet::new();
    for (i, d) in dfas.iter().enumerate() {
        match d {
            Some(d) if !d.accepts(d.start) => {}
            _ => {
                failing.insert(i); // too large to check, or matches the empty string
            }
        }
    }
    if !failing.is_empty() {
        return failing;
    }
    let dfa = |i: usize| dfas[i].as_ref();
    let first: Vec<BTreeSet<u8>> =
        dfas.iter().map(|d| d.as_ref().map(Dfa::first_bytes).unwrap_or_default()).collect();
    let sets = Sets::of(cfg);
    let follow_bytes: Vec<BTreeSet<u8>> =
        sets.follow.iter().map(|f| f.iter().flat_map(|&l| first[l].iter().copied()).collect()).collect();
    let mut checked = HashSet::new();
    for group in sets.co_allowed() {
        for &x in &group {
            for &y in &group {
                if !checked.insert((x, y)) {
                    continue;
                }
                let (Some(dx), Some(dy)) = (dfa(x), dfa(y)) else { continue };
                let cont = prefix_continuations(dx, dy);
                if cont.intersection(&follow_bytes[x]).next().is_some() {
                    // Cut the lexeme that runs on; one character cannot be cut finer.
                    let y_finer = cfg.lexemes[y].origin.len() > 1 || !single_char(&cfg.lexemes[y].origin[0]);
                    failing.insert(if y_finer { y } else { x });
                }
            }
        }
    }
    failing
}

fn single_char(item: &Item) -> bool {
    matches!(item, Item::Class { .. } | Item::Any) || matches!(item, Item::Literal(c) if c.len() <= 1)
}

/// FIRST and FOLLOW sets over lexemes.
struct Sets {
    /// Lexemes that can begin each rule; whether it can be empty.
    first: Vec<BTreeSet<usize>>,
    nullable: Vec<bool>,
    /// Lexemes that can come right after each lexeme.
    follow: Vec<BTreeSet<usize>>,
    /// Lexemes that can come right after each rule.
    rule_follow: Vec<BTreeSet<usize>>,
}

impl Sets {
    fn of(cfg: &Cfg) -> Sets {
        let mut s = Sets {
            first: vec![BTreeSet::new(); cfg.rules.len()],
            nullable: vec![false; cfg.rules.len()],
            follow: vec![BTreeSet::new(); cfg.lexemes.len()],
            rule_follow: vec![BTreeSet::new(); cfg.rules.len()],
        };
        loop {
            let mut changed = false;
            for (r, (_, alts)) in cfg.rules.iter().enumerate() {
                let (first, nullable) = s.alts_first(alts);
                changed |= first.len() != s.first[r].len() || nullable != s.nullable[r];
                s.first[r] = first;
                s.nullable[r] = nullable;
            }
            if !changed {
                break;
            }
        }
        loop {
            let before: usize = s.follow.iter().map(BTreeSet::len).sum::<usize>()
                + s.rule_follow.iter().map(BTreeSet::len).sum::<usize>();
            for (r, (_, alts)) in cfg.rules.iter().enumerate() {
                let after = s.rule_follow[r].clone();
                for alt in alts {
                    s.seq_follow(alt, &after);
                }
            }
            let now: usize = s.follow.iter().map(BTreeSet::len).sum::<usize>()
                + s.rule_follow.iter().map(BTreeSet::len).sum::<usize>();
            if now == before {
                break;
            }
        }
        s
    }

    /// FIRST of a choice among `alts`, and whether one of them can match nothing.
    fn alts_first(&self, alts: &[Vec<Elem>]) -> (BTreeSet<usize>, bool) {
        let mut first = BTreeSet::new();
        let mut nullable = false;
        for alt in alts {
            let (f, n) = self.seq_first(alt);
            first.extend(f);
            nullable |= n;
        }
        (first, nullable)
    }

    fn elem_first(&self, e: &Elem) -> (BTreeSet<usize>, bool) {
        match e {
            Elem::Lexeme(l) => ([*l].into(), false),
            Elem::Token(_) => (BTreeSet::new(), false),
            Elem::Rule(r) => (self.first[*r].clone(), self.nullable[*r]),
            Elem::Group(alts) => self.alts_first(alts),
            Elem::Repeat(inner, min, _) => {
                let (f, n) = self.elem_first(inner);
                (f, n || *min == 0)
            }
        }
    }

    fn seq_first(&self, seq: &[Elem]) -> (BTreeSet<usize>, bool) {
        let mut first = BTreeSet::new();
        for e in seq {
            let (f, n) = self.elem_first(e);
            first.extend(f);
            if !n {
                return (first, false);
            }
        }
        (first, true)
    }

    /// Record what follows each element of `seq`, given that `after` follows `seq`.
    fn seq_follow(&mut self, seq: &[Elem], after: &BTreeSet<usize>) {
        let mut next = after.clone();
        for e in seq.iter().rev() {
            self.elem_follow(e, &next);
            let (f, n) = self.elem_first(e);
            if n {
                next.extend(f);
            } else {
                next = f;
            }
        }
    }

    fn elem_follow(&mut self, e: &Elem, after: &BTreeSet<usize>) {
        match e {
            Elem::Lexeme(l) => self.follow[*l].extend(after.iter().copied()),
            Elem::Token(_) => {}
            Elem::Rule(r) => self.rule_follow[*r].extend(after.iter().copied()),
            Elem::Group(alts) => {
                for alt in alts {
                    self.seq_follow(alt, after);
                }
            }
            Elem::Repeat(inner, _, max) => {
                let mut next = after.clone();
                if max.is_none_or(|m| m > 1) {
                    next.extend(self.elem_first(inner).0);
                }
                self.elem_follow(inner, &next);
            }
        }
    }

    /// Sets of lexemes that may be allowed at one input position: what can follow one lexeme,
    /// and what can begin the grammar.
    fn co_allowed(&self) -> Vec<BTreeSet<usize>> {
        let mut out: Vec<BTreeSet<usize>> = vec![self.first[0].clone()];
        out.extend(self.follow.iter().cloned());
        // A lexeme never in a set (unreachable) is still checked against itself.
        out.extend((0..self.follow.len()).map(|l| [l].into()));
        out
    }
}
