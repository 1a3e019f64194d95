//! GBNF text as a syntax tree, read by llama.cpp's rules (`llama-grammar.cpp`): rule names of
//! `[a-zA-Z0-9-]`; literals and character classes with `\x \u \U \t \r \n` and `\\ \" \[ \] \-`
//! escapes; `.`; groups; `* + ? {m} {m,} {m,n}` applied to the item before them; token
//! references `<[id]>` and `<text>`, negated with `!`; `#` comments; a rule ends at a newline
//! except inside a group, after `::=` and after `|`. A rule defined twice keeps its last body.
//!
//! The tree is what [`super::gbnf_lark`] translates for llguidance; llama.cpp's own parser
//! still judges the grammars this reader refuses (its error messages stay the user's).

/// One item of a sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Item {
    /// Code points, in order (`"..."`; empty for `""`).
    Literal(Vec<u32>),
    /// `[...]` / `[^...]`: inclusive code point ranges.
    Class { negated: bool, ranges: Vec<(u32, u32)> },
    /// `.`: any one character.
    Any,
    /// A reference to the rule of this name.
    Rule(String),
    /// `<[id]>` / `<text>` (a special token, `text` with its brackets), `!` for "any token
    /// but this one".
    Token { negated: bool, token: TokenRef },
    /// `( alternatives )`.
    Group(Vec<Vec<Item>>),
    /// `item{min,max}` (`max` None: unbounded).
    Repeat { item: Box<Item>, min: u64, max: Option<u64> },
}

/// What a token reference names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum TokenRef {
    Id(u32),
    Text(String),
}

/// A GBNF grammar: rules in the order of their (last) definition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Syntax {
    pub rules: Vec<(String, Vec<Vec<Item>>)>,
}

impl Syntax {
    /// The alternatives of rule `name`.
    pub fn rule(&self, name: &str) -> Option<&[Vec<Item>]> {
        self.rules.iter().find(|(n, _)| n == name).map(|(_, alts)| alts.as_slice())
    }

    /// The rules that match some text (a fixed point: a rule does when one of its alternatives
    /// holds only items that do). A rule outside it matches nothing: it needs a character class
    /// with no characters (a backwards range such as `[z-a]`) or rules that only lead back to it.
    pub fn matching_rules(&self) -> std::collections::HashSet<&str> {
        let mut found = std::collections::HashSet::new();
        loop {
            let before = found.len();
            for (name, alts) in &self.rules {
                if !found.contains(name.as_str()) && sequences_match(alts, &found) {
                    found.insert(name.as_str());
                }
            }
            if found.len() == before {
                return found;
            }
        }
    }
}

fn sequences_match(alts: &[Vec<Item>], rules: &std::collections::HashSet<&str>) -> bool {
    alts.iter().any(|seq| seq.iter().all(|item| item_matches(item, rules)))
}

/// Whether `item` matches some text, given the rules that do.
fn item_matches(item: &Item, rules: &std::collections::HashSet<&str>) -> bool {
    match item {
        Item::Literal(_) | Item::Any | Item::Token { .. } => true,
        Item::Class { negated: false, ranges } => ranges.iter().any(|(lo, hi)| lo <= hi),
        Item::Class { negated: true, .. } => true,
        Item::Rule(name) => rules.contains(name.as_str()),
        Item::Group(alts) => sequences_match(alts, rules),
        Item::Repeat { item, min, .. } => *min == 0 || item_matches(item, rules),
    }
}

/// Read `text`; the reason it cannot be read, by llama.cpp's rules.
pub(crate) fn parse(text: &str) -> Result<Syntax, String> {
    let mut p = Reader { s: text.as_bytes(), i: 0 };
    let mut rules: Vec<(String, Vec<Vec<Item>>)> = Vec::new();
    p.space(true);
    while !p.done() {
        let (name, alts) = p.rule()?;
        rules.retain(|(n, _)| *n != name);
        rules.push((name, alts));
    }
    let syntax = Syntax { rules };
    for (_, alts) in &syntax.rules {
        check_refs(&syntax, alts)?;
    }
    Ok(syntax)
}

fn check_refs(syntax: &Syntax, alts: &[Vec<Item>]) -> Result<(), String> {
    for item in alts.iter().flatten() {
        match item {
            Item::Rule(name) if syntax.rule(name).is_none() => {
                return Err(format!("Undefined rule identifier '{name}'"));
            }
            Item::Group(inner) => check_refs(syntax, inner)?,
            Item::Repeat { item, .. } => check_refs(syntax, std::slice::from_ref(&vec![(**item).clone()]))?,
            _ => {}
        }
    }
    Ok(())
}

struct Reader<'a> {
    s: &'a [u8],
    i: usize,
}

fn is_word(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'-'
}

impl Reader<'_> {
    fn done(&self) -> bool {
        self.i >= self.s.len()
    }

    fn peek(&self) -> u8 {
        self.s.get(self.i).copied().unwrap_or(0)
    }

    fn at(&self, k: usize) -> u8 {
        self.s.get(self.i + k).copied().unwrap_or(0)
    }

    fn rest(&self) -> String {
        String::from_utf8_lossy(&self.s[self.i.min(self.s.len())..]).chars().take(24).collect()
    }

    fn space(&mut self, newline_ok: bool) {
        while let c @ (b' ' | b'\t' | b'#' | b'\r' | b'\n') = self.peek() {
            if (c == b'\r' || c == b'\n') && !newline_ok {
                break;
            }
            if c == b'#' {
                while !matches!(self.peek(), 0 | b'\r' | b'\n') {
                    self.i += 1;
                }
            } else {
                self.i += 1;
            }
        }
    }

    fn name(&mut self) -> Result<String, String> {
        let start = self.i;
        while is_word(self.peek()) {
            self.i += 1;
        }
        if self.i == start {
            return Err(format!("expecting name at {}", self.rest()));
        }
        Ok(String::from_utf8_lossy(&self.s[start..self.i]).into_owned())
    }

    fn int(&mut self) -> Result<u64, String> {
        let start = self.i;
        while self.peek().is_ascii_digit() {
            self.i += 1;
        }
        std::str::from_utf8(&self.s[start..self.i])
            .ok()
            .and_then(|d| d.parse().ok())
            .ok_or_else(|| format!("expecting integer at {}", self.rest()))
    }

    fn rule(&mut self) -> Result<(String, Vec<Vec<Item>>), String> {
        let name = self.name()?;
        self.space(false);
        if !self.s[self.i..].starts_with(b"::=") {
            return Err(format!("expecting ::= at {}", self.rest()));
        }
        self.i += 3;
        self.space(true);
        let alts = self.alternates(false)?;
        match self.peek() {
            b'\r' => self.i += if self.at(1) == b'\n' { 2 } else { 1 },
            b'\n' => self.i += 1,
            0 => {}
            _ => return Err(format!("expecting newline or end at {}", self.rest())),
        }
        self.space(true);
        Ok((name, alts))
    }

    fn alternates(&mut self, nested: bool) -> Result<Vec<Vec<Item>>, String> {
        let mut alts = vec![self.sequence(nested)?];
        while self.peek() == b'|' {
            self.i += 1;
            self.space(true);
            alts.push(self.sequence(nested)?);
        }
        Ok(alts)
    }

    fn sequence(&mut self, nested: bool) -> Result<Vec<Item>, String> {
        let mut seq: Vec<Item> = Vec::new();
        loop {
            let c = self.peek();
            let item = match c {
                b'"' => {
                    self.i += 1;
                    let mut chars = Vec::new();
                    while self.peek() != b'"' {
                        chars.push(self.char()?);
                    }
                    self.i += 1;
                    Item::Literal(chars)
                }
                b'[' => self.class()?,
                b'<' | b'!' => self.token()?,
                b'(' => {
                    self.i += 1;
                    self.space(true);
                    let alts = self.alternates(true)?;
                    if self.peek() != b')' {
                        return Err(format!("expecting ')' at {}", self.rest()));
                    }
                    self.i += 1;
                    Item::Group(alts)
                }
                b'.' => {
                    self.i += 1;
                    Item::Any
                }
                b'*' | b'+' | b'?' | b'{' => {
                    let (min, max) = self.repetition()?;
                    let last = seq
                        .pop()
                        .ok_or_else(|| format!("expecting preceding item to */+/?/{{ at {}", self.rest()))?;
                    seq.push(Item::Repeat { item: Box::new(last), min, max });
                    self.space(nested);
                    continue;
                }
                c if is_word(c) => Item::Rule(self.name()?),
                _ => return Ok(seq),
            };
            seq.push(item);
            self.space(nested);
        }
    }

    fn repetition(&mut self) -> Result<(u64, Option<u64>), String> {
        let c = self.peek();
        self.i += 1;
        match c {
            b'*' => return Ok((0, None)),
            b'+' => return Ok((1, None)),
            b'?' => return Ok((0, Some(1))),
            _ => {}
        }
        self.space(false);
        if !self.peek().is_ascii_digit() {
            return Err(format!("expecting an int at {}", self.rest()));
        }
        let min = self.int()?;
        self.space(false);
        let max = match self.peek() {
            b'}' => Some(min),
            b',' => {
                self.i += 1;
                self.space(false);
                let max = if self.peek().is_ascii_digit() { Some(self.int()?) } else { None };
                self.space(false);
                if self.peek() != b'}' {
                    return Err(format!("expecting '}}' at {}", self.rest()));
                }
                max
            }
            _ => return Err(format!("expecting ',' at {}", self.rest())),
        };
        self.i += 1;
        Ok((min, max))
    }

    fn class(&mut self) -> Result<Item, String> {
        self.i += 1;
        let negated = self.peek() == b'^';
        if negated {
            self.i += 1;
        }
        let mut ranges = Vec::new();
        while self.peek() != b']' {
            let lo = self.char()?;
            let hi = if self.peek() == b'-' && self.at(1) != b']' {
                if self.at(1) == 0 {
                    return Err("unexpected end of input".into());
                }
                self.i += 1;
                self.char()?
            } else {
                lo
            };
            ranges.push((lo, hi));
        }
        self.i += 1;
        Ok(Item::Class { negated, ranges })
    }

    fn token(&mut self) -> Result<Item, String> {
        let negated = self.peek() == b'!';
        if negated {
            self.i += 1;
        }
        if self.peek() != b'<' {
            return Err(format!("expecting '<' at {}", self.rest()));
        }
        let start = self.i;
        self.i += 1;
        if self.peek() == b'[' {
            self.i += 1;
            let id = self.int()?;
            if self.peek() != b']' || self.at(1) != b'>' {
                return Err(format!("expecting ']>' at {}", self.rest()));
            }
            self.i += 2;
            let id = u32::try_from(id).map_err(|_| "parsed token id is too big".to_string())?;
            return Ok(Item::Token { negated, token: TokenRef::Id(id) });
        }
        while !matches!(self.peek(), 0 | b'>') {
            self.i += 1;
        }
        if self.peek() != b'>' {
            return Err(format!("expecting '>' at {}", self.rest()));
        }
        self.i += 1;
        let text = String::from_utf8_lossy(&self.s[start..self.i]).into_owned();
        Ok(Item::Token { negated, token: TokenRef::Text(text) })
    }

    /// One character of a literal or class: an escape, or one UTF-8 encoded code point.
    fn char(&mut self) -> Result<u32, String> {
        match self.peek() {
            0 if self.done() => Err("unexpected end of input".into()),
            b'\\' => {
                let e = self.at(1);
                self.i += 2;
                match e {
                    b'x' => self.hex(2),
                    b'u' => self.hex(4),
                    b'U' => self.hex(8),
                    b't' => Ok(u32::from(b'\t')),
                    b'r' => Ok(u32::from(b'\r')),
                    b'n' => Ok(u32::from(b'\n')),
                    b'\\' | b'"' | b'[' | b']' | b'-' => Ok(u32::from(e)),
                    _ => Err(format!("unknown escape at \\{}", e as char)),
                }
            }
            _ => {
                let rest = std::str::from_utf8(&self.s[self.i..]).unwrap_or_else(|e| {
                    // Up to the first invalid byte (llama.cpp decodes it as one code point).
                    std::str::from_utf8(&self.s[self.i..self.i + e.valid_up_to()]).unwrap_or_default()
                });
                match rest.chars().next() {
                    Some(ch) => {
                        self.i += ch.len_utf8();
                        Ok(u32::from(ch))
                    }
                    None => {
                        let b = self.peek();
                        self.i += 1;
                        Ok(u32::from(b))
                    }
                }
            }
        }
    }

    fn hex(&mut self, n: usize) -> Result<u32, String> {
        let digits = self.s.get(self.i..self.i + n).ok_or_else(|| format!("expecting {n} hex chars"))?;
        let text = std::str::from_utf8(digits).map_err(|_| format!("expecting {n} hex chars"))?;
        let v = u32::from_str_radix(text, 16).map_err(|_| format!("expecting {n} hex chars at {text}"))?;
        self.i += n;
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lit(s: &str) -> Item {
        Item::Literal(s.chars().map(u32::from).collect())
    }

    #[test]
    fn rules_that_match_nothing_are_found() {
        let g = parse("root ::= \"{\" pair \"}\" | loop\npair ::= [a-(]+ \":\"\nloop ::= \"x\" loop\nok ::= [z-a]* \"y\"\n").unwrap();
        let found = g.matching_rules();
        assert!(found.contains("ok"));
        assert!(!found.contains("pair") && !found.contains("loop") && !found.contains("root"));
        let fine = parse("root ::= \"a\" root | [b-c] | ( [x-w] | \"z\" )").unwrap();
        assert!(fine.matching_rules().contains("root"));
    }

    #[test]
    fn rules_items_and_repetitions() {
        let g = parse("root ::= \"a\"+ [b-d]? x{2,3} (\"e\" | .)*\nx ::= [^\\n\\x41-\\u005A] <[7]> !<foo>\n")
            .unwrap();
        assert_eq!(g.rules.len(), 2);
        let root = g.rule("root").unwrap();
        assert_eq!(root.len(), 1);
        assert_eq!(root[0][0], Item::Repeat { item: Box::new(lit("a")), min: 1, max: None });
        assert_eq!(
            root[0][1],
            Item::Repeat {
                item: Box::new(Item::Class { negated: false, ranges: vec![(98, 100)] }),
                min: 0,
                max: Some(1)
            }
        );
        assert_eq!(root[0][2], Item::Repeat { item: Box::new(Item::Rule("x".into())), min: 2, max: Some(3) });
        assert!(matches!(&root[0][3], Item::Repeat { min: 0, max: None, .. }));
        let x = g.rule("x").unwrap();
        assert_eq!(x[0][0], Item::Class { negated: true, ranges: vec![(10, 10), (0x41, 0x5A)] });
        assert_eq!(x[0][1], Item::Token { negated: false, token: TokenRef::Id(7) });
        assert_eq!(x[0][2], Item::Token { negated: true, token: TokenRef::Text("<foo>".into()) });
    }

    #[test]
    fn newlines_end_rules_except_in_groups_and_after_bars() {
        let g =
            parse("# c\nroot ::=\n  \"a\" (\n \"b\" # x\n | \"c\"\n ) |\n  \"d\"\nws ::= | \" \"\n").unwrap();
        let root = g.rule("root").unwrap();
        assert_eq!(root.len(), 2);
        assert_eq!(root[1], vec![lit("d")]);
        assert_eq!(g.rule("ws").unwrap(), &[vec![], vec![lit(" ")]]);
        assert!(parse("root ::= \"a\"\n  | \"b\"\n").is_err(), "a new line cannot start with |");
    }

    #[test]
    fn refused_like_llama_cpp() {
        for bad in [
            "root ::= (\"a\"",
            "root ::= \"open",
            "root ::= undefined-rule",
            "root \"a\"",
            "root ::= *",
            "root ::= \"\\q\"",
            "root ::= \"a\"{x}",
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        let twice = parse("root ::= \"a\"\nroot ::= \"b\"\n").unwrap();
        assert_eq!(twice.rule("root").unwrap(), &[vec![lit("b")]], "the last definition wins");
    }
}
