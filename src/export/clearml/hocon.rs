//! A small, pure reader for the HOCON subset that `clearml.conf` uses.
//!
//! ClearML users keep their server address and credentials in
//! `~/clearml.conf`, written by `clearml-init` (an `api { … }` block with a
//! JSON-style `credentials {"access_key": …, "secret_key": …}` line,
//! followed by a large `sdk { … }` section) and often edited by hand. memtrack
//! needs only a handful of strings from it, but it parses the whole file so a
//! broken file is reported with its line instead of being half-read.
//!
//! Supported: nested objects (`a { … }`, `a: { … }`, `a = { … }`), dotted
//! keys (`google.storage { … }`), quoted and unquoted keys and values,
//! triple-quoted strings, arrays, `#` and `//` comments, optional commas,
//! value concatenation on one line, `${path}` / `${?VAR}` substitutions
//! (resolved against the file, then the environment, when a value is
//! read), and `include` lines: `include "f"`, `include file("f")` and
//! `required(…)` around either are handed to the caller's resolver
//! (`parse_with`), whose object is merged where the line stands;
//! `url(…)` and `classpath(…)` are handed over as unsupported. Objects
//! given twice are merged, as in HOCON; for other values the last one wins.
//!
//! Error messages name the line and the problem but never echo the text of
//! a value: the file holds secrets.

use std::collections::BTreeMap;

/// Nesting deeper than this is refused (no stack overflow on hostile input).
const MAX_DEPTH: usize = 64;

/// Substitutions referring to substitutions: at most this deep.
const MAX_SUBST_DEPTH: usize = 16;

/// Substitutions resolved for one value, all levels together: a file
/// where each value refers to the previous one eight times would otherwise
/// expand to 8^16 copies (a 1 KB file, gigabytes of memory).
const MAX_SUBSTITUTIONS: usize = 1_000;

/// The longest value substitutions may build (a URL or a key is far
/// shorter).
const MAX_RESOLVED_BYTES: usize = 64 * 1024;

/// What resolving one value may still spend.
struct Budget {
    substitutions: usize,
    /// The paths being resolved, outermost first: a target already among
    /// them is a cycle.
    chain: Vec<String>,
}

/// Why a file could not be read as HOCON, with the 1-based line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {message}")]
pub struct ParseError {
    pub(crate) line: usize,
    pub(crate) message: String,
}

/// A parsed value. Scalars keep their text (numbers and booleans too).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Value {
    Scalar { pieces: Vec<Piece>, line: usize },
    Object(BTreeMap<String, Value>),
    List(Vec<Value>),
}

/// One part of a (possibly concatenated) scalar.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Piece {
    Text(String),
    Subst { path: String, optional: bool },
}

/// A parsed document: the root object.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ConfTree {
    root: BTreeMap<String, Value>,
}

/// An `include` line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Include {
    /// `file`, or `url` / `classpath` (which memtrack does not read).
    pub(crate) kind: &'static str,
    pub(crate) target: String,
    /// Inside `required(…)`: a missing file is an error.
    pub(crate) required: bool,
}

/// What an `include` line brings: the included document's root object, or
/// nothing (a missing optional file, an unsupported kind).
pub(crate) type Resolve<'r> =
    dyn FnMut(Include, usize) -> Result<Option<ConfTree>, ParseError> + 'r;

impl ConfTree {
    /// The value at a dotted path (`api.credentials.access_key`).
    pub(crate) fn get(&self, path: &str) -> Option<&Value> {
        let mut parts = path.split('.');
        let mut cur = self.root.get(parts.next()?)?;
        for part in parts {
            match cur {
                Value::Object(map) => cur = map.get(part)?,
                _ => return None,
            }
        }
        Some(cur)
    }

    /// The string at `path`, substitutions resolved (`${x}` from the file,
    /// else from `env`). `Ok(None)`: absent, not a string, or an optional
    /// substitution that resolved to nothing.
    pub(crate) fn get_str(
        &self,
        path: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Option<String>, ParseError> {
        match self.get(path) {
            Some(v) => {
                let mut budget = Budget {
                    substitutions: 0,
                    chain: vec![path.to_string()],
                };
                self.resolve_value(v, env, 0, &mut budget)
            }
            None => Ok(None),
        }
    }

    /// The string a value of this tree (a list element, say) stands for,
    /// substitutions resolved as [`ConfTree::get_str`] resolves them.
    pub(crate) fn str_of(
        &self,
        v: &Value,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Option<String>, ParseError> {
        let mut budget = Budget {
            substitutions: 0,
            chain: Vec::new(),
        };
        self.resolve_value(v, env, 0, &mut budget)
    }

    fn resolve(
        &self,
        path: &str,
        env: &dyn Fn(&str) -> Option<String>,
        depth: usize,
        budget: &mut Budget,
    ) -> Result<Option<String>, ParseError> {
        match self.get(path) {
            Some(v) => {
                budget.chain.push(path.to_string());
                let resolved = self.resolve_value(v, env, depth, budget);
                budget.chain.pop();
                resolved
            }
            None => Ok(None),
        }
    }

    fn resolve_value(
        &self,
        v: &Value,
        env: &dyn Fn(&str) -> Option<String>,
        depth: usize,
        budget: &mut Budget,
    ) -> Result<Option<String>, ParseError> {
        let Value::Scalar { pieces, line } = v else {
            return Ok(None);
        };
        let mut out = String::new();
        let mut any = false;
        for piece in pieces {
            match piece {
                Piece::Text(t) => {
                    out.push_str(t);
                    any = true;
                }
                Piece::Subst {
                    path: target,
                    optional,
                } => {
                    if budget.chain.iter().any(|p| p == target) {
                        return Err(ParseError {
                            line: *line,
                            message: format!("substitution {} refers to itself", name("", target)),
                        });
                    }
                    if depth >= MAX_SUBST_DEPTH {
                        return Err(ParseError {
                            line: *line,
                            message: format!(
                                "substitutions nest too deep: {} is more than \
                                 {MAX_SUBST_DEPTH} levels down",
                                name("", target)
                            ),
                        });
                    }
                    budget.substitutions += 1;
                    if budget.substitutions > MAX_SUBSTITUTIONS {
                        return Err(ParseError {
                            line: *line,
                            message: format!(
                                "substitutions expand too far (more than {MAX_SUBSTITUTIONS} \
                                 for one value)"
                            ),
                        });
                    }
                    let found = match self.resolve(target, env, depth + 1, budget)? {
                        Some(v) => Some(v),
                        None => env(target),
                    };
                    match found {
                        Some(v) => {
                            out.push_str(&v);
                            any = true;
                            check_size(&out, *line)?;
                        }
                        None if *optional => {}
                        None => {
                            return Err(ParseError {
                                line: *line,
                                message: format!(
                                    "substitution {} is defined neither in the file nor in \
                                     the environment",
                                    name("", target)
                                ),
                            })
                        }
                    }
                }
            }
        }
        Ok(any.then_some(out))
    }
}

/// A key or substitution for an error message. A line holding only a
/// secret parses as a key, so a name is shown only when it reads like
/// one of clearml.conf's keys (lowercase words: `api.access_key`,
/// `sdk.aws.s3`) or an environment variable (`CLEARML_API_HOST`): secrets
/// and tokens mix digits and capitals. Anything else is not shown (and
/// never a long or control-laden excerpt).
fn name(what: &str, text: &str) -> String {
    let lead = if what.is_empty() {
        String::new()
    } else {
        format!("{what} ")
    };
    let lower = text
        .bytes()
        .all(|b| b.is_ascii_lowercase() || matches!(b, b'_' | b'-' | b'.'));
    // An environment variable's name (`CLEARML_API_HOST`).
    let env_var = text.contains('_') && text.bytes().all(|b| b.is_ascii_uppercase() || b == b'_');
    let plain = !text.is_empty() && text.len() <= 64 && (lower || env_var);
    if plain {
        format!("{lead}`{text}`")
    } else if what.is_empty() {
        "a name not shown (it may be a secret)".into()
    } else {
        format!("{what} (not shown: it may be a secret)")
    }
}

/// Refuses a value grown past [`MAX_RESOLVED_BYTES`].
fn check_size(out: &str, line: usize) -> Result<(), ParseError> {
    if out.len() > MAX_RESOLVED_BYTES {
        return Err(ParseError {
            line,
            message: format!(
                "a value built by substitutions is longer than {MAX_RESOLVED_BYTES} bytes"
            ),
        });
    }
    Ok(())
}

/// Parses a whole file whose `include` lines bring nothing.
pub fn parse(text: &str) -> Result<ConfTree, ParseError> {
    parse_with(text, &mut |_, _| Ok(None))
}

/// Parses a whole file; `resolve` reads what its `include` lines name
/// (given the line), and its object is merged where the line stands.
pub(crate) fn parse_with(text: &str, resolve: &mut Resolve<'_>) -> Result<ConfTree, ParseError> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut p = Parser {
        s: text.as_bytes(),
        text,
        pos: 0,
        line: 1,
        resolve,
    };
    p.skip_blank();
    let root = if p.peek() == Some(b'{') {
        let open = p.line;
        p.bump();
        let obj = p.object_body(Some(open), 1)?;
        p.skip_blank();
        if let Some(c) = p.peek() {
            return Err(p.unexpected(c, "after the closing `}` of the document"));
        }
        obj
    } else {
        p.object_body(None, 0)?
    };
    Ok(ConfTree { root })
}

struct Parser<'a, 'r> {
    s: &'a [u8],
    text: &'a str,
    pos: usize,
    line: usize,
    resolve: &'a mut Resolve<'r>,
}

impl Parser<'_, '_> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.pos).copied()
    }

    fn peek_at(&self, n: usize) -> Option<u8> {
        self.s.get(self.pos + n).copied()
    }

    fn bump(&mut self) {
        if self.peek() == Some(b'\n') {
            self.line += 1;
        }
        self.pos += 1;
    }

    fn starts_with(&self, lit: &str) -> bool {
        self.s[self.pos..].starts_with(lit.as_bytes())
    }

    fn error(&self, message: impl Into<String>) -> ParseError {
        ParseError {
            line: self.line,
            message: message.into(),
        }
    }

    /// Names a syntax character; anything else stays anonymous (it may be
    /// part of a secret).
    fn unexpected(&self, c: u8, context: &str) -> ParseError {
        let what = match c {
            b'{' | b'}' | b'[' | b']' | b':' | b'=' | b',' | b'"' | b'$' | b'.' => {
                format!("unexpected `{}`", c as char)
            }
            _ => "unexpected text".to_string(),
        };
        self.error(format!("{what} {context}"))
    }

    fn at_comment(&self) -> bool {
        self.peek() == Some(b'#') || self.starts_with("//")
    }

    fn skip_to_eol(&mut self) {
        while let Some(c) = self.peek() {
            if c == b'\n' {
                break;
            }
            self.bump();
        }
    }

    /// Spaces and tabs (and `\r`), not newlines.
    fn skip_inline(&mut self) {
        while let Some(c) = self.peek() {
            if c == b' ' || c == b'\t' || c == b'\r' || c == 0x0c {
                self.bump();
            } else if self.at_comment() {
                self.skip_to_eol();
            } else {
                break;
            }
        }
    }

    /// Whitespace, newlines and comments.
    fn skip_blank(&mut self) {
        loop {
            self.skip_inline();
            if self.peek() == Some(b'\n') {
                self.bump();
            } else {
                break;
            }
        }
    }

    /// Members until `}` (when `open` is the line of the `{`) or the end.
    fn object_body(
        &mut self,
        open: Option<usize>,
        depth: usize,
    ) -> Result<BTreeMap<String, Value>, ParseError> {
        if depth > MAX_DEPTH {
            return Err(self.error(format!("nesting deeper than {MAX_DEPTH} levels")));
        }
        let mut map = BTreeMap::new();
        loop {
            self.skip_blank();
            match self.peek() {
                None => {
                    return match open {
                        Some(line) => Err(self.error(format!(
                            "the file ends inside the `{{` opened on line {line} (missing `}}`)"
                        ))),
                        None => Ok(map),
                    };
                }
                Some(b'}') => {
                    return match open {
                        Some(_) => {
                            self.bump();
                            Ok(map)
                        }
                        None => Err(self.error("`}` without a matching `{`")),
                    };
                }
                Some(b',') => {
                    self.bump();
                    continue;
                }
                Some(_) => {}
            }
            if self.at_include() {
                let line = self.line;
                let include = self.include()?;
                if let Some(tree) = (self.resolve)(include, line)? {
                    for (k, v) in tree.root {
                        insert(&mut map, std::slice::from_ref(&k), v);
                    }
                }
                self.skip_to_eol();
                continue;
            }
            let key_line = self.line;
            let path = self.key()?;
            self.skip_inline();
            let value = match self.peek() {
                Some(b'{') => self.value(depth)?,
                Some(b':') | Some(b'=') => {
                    self.bump();
                    self.skip_inline();
                    self.value(depth)?
                }
                Some(b'+') if self.peek_at(1) == Some(b'=') => {
                    self.bump();
                    self.bump();
                    self.skip_inline();
                    self.value(depth)?
                }
                _ => {
                    return Err(ParseError {
                        line: key_line,
                        message: format!(
                            "expected `:`, `=` or `{{` after {}",
                            name("the key", &path.join("."))
                        ),
                    })
                }
            };
            insert(&mut map, &path, value);
            // A member ends at a newline, a comma or the closing brace.
            self.skip_inline();
            match self.peek() {
                None | Some(b'\n') | Some(b',') | Some(b'}') => {}
                Some(c) => {
                    return Err(self.unexpected(
                        c,
                        &format!("after the value of {}", name("", &path.join("."))),
                    ))
                }
            }
        }
    }

    fn at_include(&self) -> bool {
        if !self.starts_with("include") {
            return false;
        }
        match self.peek_at(7) {
            Some(b' ') | Some(b'\t') => {
                let rest = self.text[self.pos + 7..].trim_start();
                rest.starts_with('"')
                    || rest.starts_with("required(")
                    || rest.starts_with("file(")
                    || rest.starts_with("url(")
                    || rest.starts_with("classpath(")
            }
            _ => false,
        }
    }

    /// An `include` line after its keyword: `"f"`, `file("f")`, `url(…)`,
    /// `classpath(…)`, or `required(` one of them `)`.
    fn include(&mut self) -> Result<Include, ParseError> {
        for _ in 0.."include".len() {
            self.bump();
        }
        self.skip_inline();
        let required = self.starts_with("required(");
        if required {
            for _ in 0.."required(".len() {
                self.bump();
            }
            self.skip_inline();
        }
        let kind = ["file", "url", "classpath"]
            .into_iter()
            .find(|k| self.starts_with(k) && self.peek_at(k.len()) == Some(b'('));
        if let Some(k) = kind {
            for _ in 0..=k.len() {
                self.bump();
            }
            self.skip_inline();
        }
        if self.peek() != Some(b'"') {
            return Err(self.error("an `include` names a quoted file (`include \"other.conf\"`)"));
        }
        let target = self.quoted()?;
        self.skip_inline();
        let closing = usize::from(kind.is_some()) + usize::from(required);
        for _ in 0..closing {
            if self.peek() != Some(b')') {
                return Err(self.error("an `include` line is missing a `)`"));
            }
            self.bump();
            self.skip_inline();
        }
        Ok(Include {
            kind: kind.unwrap_or("file"),
            target,
            required,
        })
    }

    /// A key path: `a`, `a.b`, `"a.b"`, `"a".b`.
    fn key(&mut self) -> Result<Vec<String>, ParseError> {
        let mut parts = Vec::new();
        loop {
            let part = match self.peek() {
                Some(b'"') => self.quoted()?,
                Some(c) if is_key_char(c) => {
                    let start = self.pos;
                    while self.peek().is_some_and(is_key_char) && !self.at_comment() {
                        self.bump();
                    }
                    self.text[start..self.pos].trim_end().to_string()
                }
                Some(c) => return Err(self.unexpected(c, "where a key was expected")),
                None => return Err(self.error("the file ends where a key was expected")),
            };
            parts.push(part);
            if self.peek() == Some(b'.') {
                self.bump();
            } else {
                return Ok(parts);
            }
        }
    }

    fn value(&mut self, depth: usize) -> Result<Value, ParseError> {
        match self.peek() {
            Some(b'{') => {
                let open = self.line;
                self.bump();
                Ok(Value::Object(self.object_body(Some(open), depth + 1)?))
            }
            Some(b'[') => self.list(depth + 1),
            None | Some(b'\n') | Some(b',') | Some(b'}') | Some(b']') => {
                Err(self.error("a value is missing"))
            }
            Some(_) => self.scalar(),
        }
    }

    fn list(&mut self, depth: usize) -> Result<Value, ParseError> {
        if depth > MAX_DEPTH {
            return Err(self.error(format!("nesting deeper than {MAX_DEPTH} levels")));
        }
        let open = self.line;
        self.bump();
        let mut items = Vec::new();
        loop {
            self.skip_blank();
            match self.peek() {
                None => {
                    return Err(self.error(format!(
                        "the file ends inside the `[` opened on line {open} (missing `]`)"
                    )))
                }
                Some(b']') => {
                    self.bump();
                    return Ok(Value::List(items));
                }
                Some(b',') => {
                    self.bump();
                }
                Some(_) => {
                    items.push(self.value(depth)?);
                    self.skip_inline();
                    match self.peek() {
                        None | Some(b'\n') | Some(b',') | Some(b']') => {}
                        Some(c) => return Err(self.unexpected(c, "inside a list")),
                    }
                }
            }
        }
    }

    /// Quoted, unquoted and substituted pieces up to the end of the value.
    fn scalar(&mut self) -> Result<Value, ParseError> {
        let line = self.line;
        let mut pieces: Vec<Piece> = Vec::new();
        let mut pending_ws = String::new();
        loop {
            match self.peek() {
                None | Some(b'\n') | Some(b',') | Some(b'}') | Some(b']') => break,
                Some(b'#') => break,
                Some(b'/') if self.starts_with("//") && !pending_ws.is_empty() => break,
                Some(b' ') | Some(b'\t') | Some(b'\r') => {
                    pending_ws.push(self.peek().map_or(' ', char::from));
                    self.bump();
                    continue;
                }
                Some(b'{') | Some(b'[') => {
                    return Err(
                        self.error("an object or list cannot be joined to text on the same line")
                    )
                }
                _ => {}
            }
            if !pieces.is_empty() && !pending_ws.is_empty() {
                push_text(&mut pieces, &pending_ws);
            }
            pending_ws.clear();
            if self.starts_with("\"\"\"") {
                let t = self.triple_quoted()?;
                push_text(&mut pieces, &t);
            } else if self.peek() == Some(b'"') {
                let t = self.quoted()?;
                push_text(&mut pieces, &t);
            } else if self.starts_with("${") {
                pieces.push(self.substitution()?);
            } else {
                let start = self.pos;
                while let Some(c) = self.peek() {
                    let stop = matches!(
                        c,
                        b'\n'
                            | b','
                            | b'}'
                            | b']'
                            | b'{'
                            | b'['
                            | b'#'
                            | b'"'
                            | b' '
                            | b'\t'
                            | b'\r'
                    ) || (c == b'$' && self.peek_at(1) == Some(b'{'));
                    if stop {
                        break;
                    }
                    self.bump();
                }
                if self.pos == start {
                    // `$` not starting a substitution, handled as text.
                    self.bump();
                }
                push_text(&mut pieces, &self.text[start..self.pos]);
            }
        }
        if pieces.is_empty() {
            return Err(ParseError {
                line,
                message: "a value is missing".into(),
            });
        }
        Ok(Value::Scalar { pieces, line })
    }

    fn substitution(&mut self) -> Result<Piece, ParseError> {
        let line = self.line;
        self.bump();
        self.bump();
        let optional = self.peek() == Some(b'?');
        if optional {
            self.bump();
        }
        let start = self.pos;
        while let Some(c) = self.peek() {
            if c == b'}' {
                let path = self.text[start..self.pos].trim().to_string();
                self.bump();
                if path.is_empty() {
                    return Err(ParseError {
                        line,
                        message: "empty substitution `${}`".into(),
                    });
                }
                return Ok(Piece::Subst { path, optional });
            }
            if c == b'\n' {
                break;
            }
            self.bump();
        }
        Err(ParseError {
            line,
            message: "unterminated substitution (missing `}` after `${`)".into(),
        })
    }

    /// A JSON-style `"…"` string with escapes.
    fn quoted(&mut self) -> Result<String, ParseError> {
        let line = self.line;
        self.bump();
        let mut out = String::new();
        loop {
            let Some(c) = self.peek() else {
                return Err(ParseError {
                    line,
                    message: "unterminated quoted string (missing closing `\"`)".into(),
                });
            };
            match c {
                b'"' => {
                    self.bump();
                    return Ok(out);
                }
                b'\n' => {
                    return Err(ParseError {
                        line,
                        message: "unterminated quoted string (missing closing `\"`)".into(),
                    })
                }
                b'\\' => {
                    self.bump();
                    let esc = self
                        .peek()
                        .ok_or_else(|| self.error("unterminated escape"))?;
                    self.bump();
                    match esc {
                        b'"' => out.push('"'),
                        b'\\' => out.push('\\'),
                        b'/' => out.push('/'),
                        b'b' => out.push('\u{8}'),
                        b'f' => out.push('\u{c}'),
                        b'n' => out.push('\n'),
                        b'r' => out.push('\r'),
                        b't' => out.push('\t'),
                        b'u' => {
                            let hex = self
                                .text
                                .get(self.pos..self.pos + 4)
                                .and_then(|h| u32::from_str_radix(h, 16).ok())
                                .ok_or_else(|| self.error("bad `\\u` escape in a quoted string"))?;
                            self.pos += 4;
                            out.push(char::from_u32(hex).unwrap_or('\u{fffd}'));
                        }
                        _ => return Err(self.error("unknown escape in a quoted string")),
                    }
                }
                _ => {
                    // Copy one UTF-8 character.
                    let start = self.pos;
                    self.bump();
                    while self.peek().is_some_and(|b| (b & 0xC0) == 0x80) {
                        self.bump();
                    }
                    out.push_str(&self.text[start..self.pos]);
                }
            }
        }
    }

    fn triple_quoted(&mut self) -> Result<String, ParseError> {
        let line = self.line;
        for _ in 0..3 {
            self.bump();
        }
        let start = self.pos;
        while self.pos < self.s.len() {
            if self.starts_with("\"\"\"") {
                // Extra quotes before the closing three belong to the string.
                let mut end = self.pos;
                while self.s.get(end + 3) == Some(&b'"') {
                    end += 1;
                }
                let out = self.text[start..end].to_string();
                while self.pos < end + 3 {
                    self.bump();
                }
                return Ok(out);
            }
            self.bump();
        }
        Err(ParseError {
            line,
            message: "unterminated `\"\"\"` string".into(),
        })
    }
}

fn is_key_char(c: u8) -> bool {
    !matches!(
        c,
        b' ' | b'\t'
            | b'\r'
            | b'\n'
            | b'.'
            | b':'
            | b'='
            | b'{'
            | b'}'
            | b'['
            | b']'
            | b','
            | b'"'
            | b'#'
            | b'+'
            | b'$'
    )
}

fn push_text(pieces: &mut Vec<Piece>, text: &str) {
    if let Some(Piece::Text(last)) = pieces.last_mut() {
        last.push_str(text);
    } else {
        pieces.push(Piece::Text(text.to_string()));
    }
}

/// Sets `path` in `map`, merging objects as HOCON does.
fn insert(map: &mut BTreeMap<String, Value>, path: &[String], value: Value) {
    let Some((first, rest)) = path.split_first() else {
        return;
    };
    if rest.is_empty() {
        match (map.get_mut(first), value) {
            (Some(Value::Object(old)), Value::Object(new)) => {
                for (k, v) in new {
                    insert(old, std::slice::from_ref(&k), v);
                }
            }
            (_, value) => {
                map.insert(first.clone(), value);
            }
        }
        return;
    }
    let slot = map
        .entry(first.clone())
        .or_insert_with(|| Value::Object(BTreeMap::new()));
    if !matches!(slot, Value::Object(_)) {
        *slot = Value::Object(BTreeMap::new());
    }
    if let Value::Object(inner) = slot {
        insert(inner, rest, value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn s(doc: &ConfTree, path: &str) -> Option<String> {
        doc.get_str(path, &no_env).unwrap()
    }

    /// The header `clearml-init` writes (clearml/cli/config/__main__.py),
    /// followed by the start of the default `sdk.conf` it appends.
    const CLEARML_INIT: &str = r#"# ClearML SDK configuration file
api {
    # Notice: 'host' is the api server (default port 8008), not the web server.
    api_server: http://localhost:8008
    web_server: http://localhost:8080
    files_server: http://localhost:8081
    # Credentials are generated using the webapp, http://localhost:8080/settings
    # Override with os environment: CLEARML_API_ACCESS_KEY / CLEARML_API_SECRET_KEY
    credentials {"access_key": "EXAMPLEKEY123", "secret_key": "example-Secret_456"}
}
sdk {
    # ClearML - default SDK configuration

    storage {
        cache {
            # Defaults to <system_temp_folder>/clearml_cache
            default_base_dir: "~/.clearml/cache"
            # default_cache_manager_size: 100
        }

        direct_access: [
            # Objects matching are considered to be available for direct access
            { url: "file://*" }  # file-urls are always directly referenced
        ]
    }

    metrics {
        file_history_size: 100
        # plot_max_num_digits: 5
        images {
            format: JPEG
            quality: 87
            subsampling: 0
        }
        tensorboard_single_series_per_graph: false
    }
    aws {
        s3 {
            region: ""
            key: ""
            secret: ""
            use_credentials_chain: false
            extra_args: {}
            credentials: [
                # {
                #     bucket: "my-bucket-name"
                #     key: "my-access-key"
                # },
            ]
        }
        boto3 {
            pool_connections: 512
            multipart_threshold: 8388608 # 8MB
        }
    }
    google.storage {
        # project: "clearml"
    }
    azure.storage {
        # containers: [
        #     {
        #         account_name: "clearml"
        #     }
        # ]
    }
    development {
        task_reuse_time_window_in_hours: 72.0
        log_os_environments: []
        worker {
            report_period_sec: 2
        }
    }
    apply_environment: false
}
"#;

    #[test]
    fn reads_what_clearml_init_writes() {
        let doc = parse(CLEARML_INIT).unwrap();
        assert_eq!(
            s(&doc, "api.api_server").as_deref(),
            Some("http://localhost:8008")
        );
        assert_eq!(
            s(&doc, "api.files_server").as_deref(),
            Some("http://localhost:8081")
        );
        assert_eq!(
            s(&doc, "api.credentials.access_key").as_deref(),
            Some("EXAMPLEKEY123")
        );
        assert_eq!(
            s(&doc, "api.credentials.secret_key").as_deref(),
            Some("example-Secret_456")
        );
        assert_eq!(
            s(&doc, "sdk.metrics.images.format").as_deref(),
            Some("JPEG")
        );
        assert_eq!(
            s(&doc, "sdk.aws.boto3.multipart_threshold").as_deref(),
            Some("8388608")
        );
        assert!(matches!(
            doc.get("sdk.google.storage"),
            Some(Value::Object(_))
        ));
        assert!(matches!(
            doc.get("sdk.storage.direct_access"),
            Some(Value::List(l)) if l.len() == 1
        ));
    }

    #[test]
    fn equals_commas_quoted_keys_and_slashes() {
        let doc = parse(
            "api = {\n  \"api_server\" = \"https://api.example.com:443/\", web_server = https://app.example.com // the UI\n\
             credentials = { access_key = K1, \"secret_key\": 'S1' }\n}\n",
        )
        .unwrap();
        assert_eq!(
            s(&doc, "api.api_server").as_deref(),
            Some("https://api.example.com:443/")
        );
        assert_eq!(
            s(&doc, "api.web_server").as_deref(),
            Some("https://app.example.com")
        );
        assert_eq!(s(&doc, "api.credentials.access_key").as_deref(), Some("K1"));
        // Single quotes are not HOCON quotes: the text is kept as is.
        assert_eq!(
            s(&doc, "api.credentials.secret_key").as_deref(),
            Some("'S1'")
        );
    }

    #[test]
    fn dotted_keys_merge_and_last_wins() {
        let doc = parse(
            "api.api_server: http://a:8008\napi { web_server: http://w }\napi.api_server: http://b:8008\n",
        )
        .unwrap();
        assert_eq!(s(&doc, "api.api_server").as_deref(), Some("http://b:8008"));
        assert_eq!(s(&doc, "api.web_server").as_deref(), Some("http://w"));
    }

    #[test]
    fn root_braces_crlf_bom_and_triple_quotes() {
        let doc = parse("\u{feff}{\r\n  a: \"\"\"x \"y\" z\"\"\"\r\n  b: 1 2 3\r\n}\r\n").unwrap();
        assert_eq!(s(&doc, "a").as_deref(), Some("x \"y\" z"));
        assert_eq!(s(&doc, "b").as_deref(), Some("1 2 3"));
    }

    #[test]
    fn substitutions_come_from_the_file_then_the_environment() {
        let doc = parse(
            "host: \"http://h\"\napi {\n  api_server: ${host}\":8008\"\n  credentials {\n    \"access_key\": ${CLEARML_KEY}\n    \"secret_key\": ${?NOPE}\n  }\n}\n",
        )
        .unwrap();
        let env = |k: &str| (k == "CLEARML_KEY").then(|| "from-env".to_string());
        assert_eq!(
            doc.get_str("api.api_server", &env).unwrap().as_deref(),
            Some("http://h:8008")
        );
        assert_eq!(
            doc.get_str("api.credentials.access_key", &env)
                .unwrap()
                .as_deref(),
            Some("from-env")
        );
        assert_eq!(
            doc.get_str("api.credentials.secret_key", &env).unwrap(),
            None
        );
        let err = doc
            .get_str("api.credentials.access_key", &no_env)
            .unwrap_err();
        assert_eq!(err.line, 5);
        assert!(err.message.contains("CLEARML_KEY"), "{err}");
        let looped = parse("a: ${b}\nb: ${a}\n").unwrap();
        let err = looped.get_str("a", &no_env).unwrap_err();
        assert!(err.message.contains("refers to itself"), "{err}");
        // A chain 17 deep has no cycle: it is too deep, and says so.
        let mut text = String::from("l0: x\n");
        for i in 1..=17 {
            text.push_str(&format!("l{i}: ${{l{}}}\n", i - 1));
        }
        let err = parse(&text).unwrap().get_str("l17", &no_env).unwrap_err();
        assert!(err.message.contains("nest too deep"), "{err}");
        assert!(!err.message.contains("itself"), "{err}");
    }

    #[test]
    fn includes_are_handed_to_the_resolver_and_merged_where_they_stand() {
        let text = "a: 0\nb { x: 1 }\ninclude \"other.conf\"\ninclude required(file( \"x\" ))\n\
                    include url(\"http://h/c\")\nc: 3\n";
        let mut seen = Vec::new();
        let doc = parse_with(text, &mut |inc, line| {
            seen.push((inc.clone(), line));
            Ok((inc.target == "other.conf").then(|| parse("a: 1\nb { y: 2 }\nc: 1\n").unwrap()))
        })
        .unwrap();
        // Later lines win over the include; objects merge.
        assert_eq!(s(&doc, "a").as_deref(), Some("1"));
        assert_eq!(s(&doc, "b.x").as_deref(), Some("1"));
        assert_eq!(s(&doc, "b.y").as_deref(), Some("2"));
        assert_eq!(s(&doc, "c").as_deref(), Some("3"));
        let file = |target: &str, required| Include {
            kind: "file",
            target: target.into(),
            required,
        };
        let url = Include {
            kind: "url",
            target: "http://h/c".into(),
            required: false,
        };
        assert_eq!(
            seen,
            vec![
                (file("other.conf", false), 3),
                (file("x", true), 4),
                (url, 5)
            ]
        );
        for bad in [
            "include other.conf\n",
            "include required(\"x\"\n",
            "include file(\"x\"\n",
        ] {
            let e = parse(bad).unwrap_err();
            assert_eq!(e.line, 1, "{bad}: {e:?}");
            assert!(e.message.contains("include"), "{bad}: {e:?}");
        }
    }

    #[test]
    fn errors_name_the_line_and_never_the_secret() {
        let cases: &[(&str, usize, &str)] = &[
            ("api {\n  api_server: http://x\n", 3, "missing `}`"),
            ("api {\n}\n}\n", 3, "`}` without a matching `{`"),
            (
                "api {\n  credentials {\"access_key\": \"TOPSECRET}\n}\n",
                2,
                "unterminated quoted string",
            ),
            (
                "api {\n  access_key TOPSECRET\n}\n",
                2,
                "expected `:`, `=` or `{` after the key `access_key`",
            ),
            ("a: [1, 2\n", 2, "missing `]`"),
            ("a:\n", 1, "a value is missing"),
            ("a: ${x\n", 1, "unterminated substitution"),
            ("a: \"TOPSECRET\" {\n}\n", 1, "cannot be joined"),
        ];
        for (text, line, what) in cases {
            let err = parse(text).unwrap_err();
            assert_eq!(err.line, *line, "{text:?}: {err}");
            assert!(err.message.contains(what), "{text:?}: {err}");
            assert!(!err.to_string().contains("TOPSECRET"), "{err}");
        }
    }

    #[test]
    fn a_substitution_bomb_stops_at_its_budget() {
        // Each level refers to the one below eight times: 8^16 bytes.
        let mut text = String::from("l0: aaaaaaaa\n");
        for i in 1..16 {
            text.push_str(&format!("l{i}: {}\n", format!("${{l{}}}", i - 1).repeat(8)));
        }
        assert!(text.len() < 1024, "{}", text.len());
        let doc = parse(&text).unwrap();
        let err = doc.get_str("l15", &no_env).unwrap_err();
        assert!(err.message.contains("expand too far"), "{err}");
        // Wide rather than deep: the size budget.
        let mut text = format!("l0: \"{}\"\n", "a".repeat(60_000));
        text.push_str("l1: ${l0}${l0}\n");
        let err = parse(&text).unwrap().get_str("l1", &no_env).unwrap_err();
        assert!(err.message.contains("longer than"), "{err}");
        // A few levels stay fine.
        let doc = parse("a: x\nb: ${a}${a}\nc: ${b}-${b}\n").unwrap();
        assert_eq!(s(&doc, "c").as_deref(), Some("xx-xx"));
    }

    #[test]
    fn a_secret_alone_on_a_line_or_a_binary_file_is_never_echoed() {
        for text in [
            "api {\n  secret_key: abc\n  Zk9TOPSECRETqW2x\n}\n",
            "api {\n  sdk.TOPSECRET: 1 2 ]\n}\n",
            "a: ${TOPSECRET9}\n",
        ] {
            let err = match parse(text) {
                Err(e) => e,
                Ok(doc) => doc.get_str("a", &no_env).unwrap_err(),
            };
            assert!(!err.to_string().contains("TOPSECRET"), "{err}");
            assert!(err.to_string().contains("not shown"), "{err}");
        }
        let zeros = "\0".repeat(1 << 20);
        let err = parse(&zeros).unwrap_err().to_string();
        assert!(err.len() < 200 && !err.contains('\0'), "{}", err.len());
    }

    #[test]
    fn deep_nesting_is_refused() {
        let text = "a {".repeat(100) + &"}".repeat(100);
        assert!(parse(&text).unwrap_err().message.contains("nesting"));
    }
}
