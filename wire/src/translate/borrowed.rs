//! Anthropic Messages request → chat completions body without building the owned request:
//! the body is parsed into types that borrow their strings from it, and the chat body is written
//! straight into one buffer sized once.
//!
//! Why: on the proxy's and the bridge's hot path (a 100 KB Claude Code request per model
//! call) the owned path unescaped every long string into a fresh `String` (serde's buffering of
//! internally tagged blocks copies them once more), and escaped it again when writing the chat
//! body. Here a string is kept as the *escaped* text the client wrote, between its quotes: that
//! text is valid inside a JSON string of the chat body as it is, so message text, tool
//! descriptions and arguments are copied once, never unescaped nor re-escaped; only strings
//! that must be read (block types, tool names, the billing-header prefix) are unescaped, and
//! they are short. A string with non-canonical escapes (`\u00e9`, `\/`) keeps them: the chat
//! body means the same, byte for byte it may differ from the owned path's.
//!
//! The contract is the owned path's ([`super::anthropic_into_chat`], whose rules the module
//! docs of [`crate::translate`] state): [`AnthropicBody::parse`] answers `None` for every body
//! it does not take on exactly, and the caller then runs the owned path, which gives the answer
//! it always gave, errors included. `None` covers: a body that is not JSON or not UTF-8, any
//! serde error, a `\u` escape of a lone surrogate anywhere in the body (serde_json checks
//! those only in strings it unescapes, and this path unescapes few), mid-conversation
//! `role: "system"` messages (folded by [`crate::normalize`]), image and document blocks, a
//! block of a known type whose fields are missing or of the wrong type, and blocks where the
//! owned path refuses them (a `tool_use` in a user turn, a `tool_result` in an assistant turn).
//! What the owned path would refuse is therefore still refused, by it. One difference remains:
//! members this path never reads (unknown fields) are checked for syntax, UTF-8 and lone
//! surrogates, but not for numbers beyond `f64`'s range, which the owned path's `Value` refuses.

use std::borrow::Cow;
use std::collections::HashSet;
use std::fmt;
use std::fmt::Write as _;

use serde::Deserialize;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde_json::value::RawValue;
use serde_json::{Map, Number, Value};

use super::tool_names::upstream_tool_name;
use super::{ChatOptions, ResponseOptions, ToolNames};
use crate::anthropic::{Metadata, Role, ThinkingConfig, ToolChoice};
use crate::chat::{ChatToolChoice, StreamOptions};
use crate::normalize::BILLING_HEADER_PREFIX;
use crate::serde_util::escape_into;

/// The escaped text of the string `raw` holds, between its quotes; `None` when `raw` is not a
/// string. That text is valid inside a JSON string of any other body as it is.
fn escaped(raw: &RawValue) -> Option<&str> {
    raw.get()
        .strip_prefix('"')
        .and_then(|s| s.strip_suffix('"'))
}

/// The string an escaped text stands for (short strings only: this copies when there are
/// escapes).
fn unescape(escaped: &str) -> Option<Cow<'_, str>> {
    if !escaped.contains('\\') {
        return Some(Cow::Borrowed(escaped));
    }
    let mut quoted = String::with_capacity(escaped.len() + 2);
    quoted.push('"');
    quoted.push_str(escaped);
    quoted.push('"');
    serde_json::from_str::<String>(&quoted).ok().map(Cow::Owned)
}

/// Whether the string an escaped text stands for starts with `prefix`.
fn starts_with(escaped: &str, prefix: &str) -> bool {
    // An escape in the first bytes could spell part of the prefix.
    let head = escaped.get(..(prefix.len() * 6).min(escaped.len()));
    if head.is_some_and(|h| !h.contains('\\')) {
        return escaped.starts_with(prefix);
    }
    unescape(escaped).is_some_and(|s| s.starts_with(prefix))
}

/// A `content`: a string (escaped, see [`escaped`]) or a list of blocks.
#[derive(Debug)]
enum Content<'a> {
    Text(Cow<'a, str>),
    List(Vec<Block<'a>>),
}

impl<'de: 'a, 'a> Deserialize<'de> for Content<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Content<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or an array")
            }
            // serde_json lends a string only when it has no escapes: then the text is its own
            // escaped form.
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Content::Text(Cow::Borrowed(v)))
            }
            // It had escapes, which serde_json resolved: escaped again, as serde_json escapes.
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                let mut out = String::with_capacity(v.len() + v.len() / 16);
                escape_into(&mut out, v);
                Ok(Content::Text(Cow::Owned(out)))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(Content::List(items))
            }
        }
        deserializer.deserialize_any(V(std::marker::PhantomData))
    }
}

/// One content block, every kind's fields in one struct, each kept raw until its kind says
/// what it must be. Unknown fields are skipped.
#[derive(Debug, Deserialize)]
struct Block<'a> {
    #[serde(rename = "type", default, borrow)]
    kind: Option<&'a RawValue>,
    #[serde(default, borrow)]
    text: Option<&'a RawValue>,
    #[serde(default, borrow)]
    id: Option<&'a RawValue>,
    #[serde(default, borrow)]
    name: Option<&'a RawValue>,
    #[serde(default, borrow)]
    input: Option<&'a RawValue>,
    #[serde(default, borrow)]
    tool_use_id: Option<&'a RawValue>,
    #[serde(default, borrow)]
    content: Option<Content<'a>>,
    #[serde(default, borrow)]
    is_error: Option<&'a RawValue>,
    #[serde(default, borrow)]
    thinking: Option<&'a RawValue>,
    #[serde(default, borrow)]
    signature: Option<&'a RawValue>,
    #[serde(default, borrow)]
    data: Option<&'a RawValue>,
}

/// What a block is, once checked against its kind's required fields; strings escaped.
enum Kind<'b, 'a> {
    Text(&'a str),
    ToolUse {
        id: &'a str,
        name: &'a str,
        input: &'a RawValue,
    },
    ToolResult {
        tool_use_id: &'a str,
        content: Option<&'b Content<'a>>,
    },
    Thinking(&'a str),
    RedactedThinking,
    /// A type the owned path keeps as `Other` and drops.
    Unknown,
}

fn is_string_or_null(v: Option<&RawValue>) -> bool {
    v.is_none_or(|r| r.get().starts_with('"'))
}

impl<'a> Block<'a> {
    /// The block's kind; `None` for what this path leaves to the owned one (a known kind with
    /// bad fields, images, documents).
    fn kind(&self) -> Option<Kind<'_, 'a>> {
        let Some(kind) = self.kind else {
            return Some(Kind::Unknown);
        };
        let Some(kind) = escaped(kind) else {
            return Some(Kind::Unknown);
        };
        let kind = unescape(kind)?;
        let string = |v: Option<&'a RawValue>| v.and_then(escaped);
        Some(match kind.as_ref() {
            "text" => Kind::Text(string(self.text)?),
            "tool_use" => Kind::ToolUse {
                id: string(self.id)?,
                name: string(self.name)?,
                input: self.input?,
            },
            "tool_result" => {
                let is_error_ok = self
                    .is_error
                    .is_none_or(|r| matches!(r.get(), "true" | "false"));
                if !is_error_ok {
                    return None;
                }
                Kind::ToolResult {
                    tool_use_id: string(self.tool_use_id)?,
                    content: self.content.as_ref(),
                }
            }
            "thinking" => {
                if !is_string_or_null(self.signature) {
                    return None;
                }
                Kind::Thinking(string(self.thinking)?)
            }
            "redacted_thinking" => {
                string(self.data)?;
                Kind::RedactedThinking
            }
            "image" | "document" => return None,
            _ => Kind::Unknown,
        })
    }
}

#[derive(Debug, Deserialize)]
struct Msg<'a> {
    role: Role,
    #[serde(borrow)]
    content: Content<'a>,
}

#[derive(Debug, Deserialize)]
struct ToolDef<'a> {
    /// `null` kept as a value: the owned type refuses it.
    #[serde(default, borrow, deserialize_with = "present")]
    name: Option<&'a RawValue>,
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default, borrow)]
    description: Option<&'a RawValue>,
    #[serde(default, borrow)]
    input_schema: Option<&'a RawValue>,
    #[serde(default, borrow)]
    strict: Option<&'a RawValue>,
}

/// A member that is there, `null` included.
fn present<'de: 'a, 'a, D: Deserializer<'de>>(d: D) -> Result<Option<&'a RawValue>, D::Error> {
    <&'a RawValue>::deserialize(d).map(Some)
}

impl ToolDef<'_> {
    fn is_server_tool(&self) -> bool {
        self.kind.as_deref().is_some_and(|k| k != "custom")
    }
}

#[derive(Debug, Deserialize)]
struct Req<'a> {
    #[serde(borrow)]
    model: &'a RawValue,
    #[serde(borrow)]
    messages: Vec<Msg<'a>>,
    #[serde(default, borrow)]
    system: Option<Content<'a>>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    temperature: Option<Number>,
    #[serde(default)]
    top_p: Option<Number>,
    #[serde(default)]
    top_k: Option<u64>,
    #[serde(default)]
    metadata: Option<Metadata>,
    #[serde(default, borrow)]
    tools: Option<Vec<ToolDef<'a>>>,
    #[serde(default)]
    tool_choice: Option<ToolChoice>,
    #[serde(default)]
    thinking: Option<ThinkingConfig>,
    #[serde(default, borrow)]
    output_config: Option<&'a RawValue>,
    #[serde(default, borrow)]
    output_format: Option<&'a RawValue>,
}

/// The top level of [`AnthropicBody::parse_unique_keys`]: [`Req`]'s own deserializer, fed the
/// object's members through [`UniqueMembers`], which refuses a key seen before.
struct UniqueKeys;

impl<'de> Visitor<'de> for UniqueKeys {
    type Value = Req<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Req<'de>, A::Error> {
        Req::deserialize(de::value::MapAccessDeserializer::new(UniqueMembers {
            map,
            seen: HashSet::with_capacity(32),
        }))
    }
}

/// An object's members as they come, each key checked against the keys before it.
struct UniqueMembers<'de, A> {
    map: A,
    seen: HashSet<Cow<'de, str>>,
}

impl<'de, A: de::MapAccess<'de>> de::MapAccess<'de> for UniqueMembers<'de, A> {
    type Error = A::Error;

    fn next_key_seed<K: de::DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, A::Error> {
        let Some(key) = self.map.next_key_seed(KeyText)? else {
            return Ok(None);
        };
        // The key is handed on as the text it is, borrowed or unescaped.
        let value = match &key {
            Cow::Borrowed(k) => {
                seed.deserialize(de::value::BorrowedStrDeserializer::<A::Error>::new(k))?
            }
            Cow::Owned(k) => seed.deserialize(de::value::StrDeserializer::<A::Error>::new(k))?,
        };
        if !self.seen.insert(key) {
            return Err(de::Error::custom("a top-level key appears twice"));
        }
        Ok(Some(value))
    }

    fn next_value_seed<V: de::DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, A::Error> {
        self.map.next_value_seed(seed)
    }

    fn size_hint(&self) -> Option<usize> {
        self.map.size_hint()
    }
}

/// A key, borrowed from the body when it has no escapes.
struct KeyText;

impl<'de> de::DeserializeSeed<'de> for KeyText {
    type Value = Cow<'de, str>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Cow<'de, str>, D::Error> {
        d.deserialize_str(KeyText)
    }
}

impl<'de> Visitor<'de> for KeyText {
    type Value = Cow<'de, str>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string key")
    }
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Cow<'de, str>, E> {
        Ok(Cow::Borrowed(v))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Cow<'de, str>, E> {
        Ok(Cow::Owned(v.to_owned()))
    }
}

/// A body with no `\u` escape anywhere in it (so no lone surrogate either), made only by
/// [`NoUnicodeEscapes::check`]: the proof one search over the body passes on, so the next step
/// does not search it again.
#[derive(Debug, Clone, Copy)]
pub struct NoUnicodeEscapes<'a>(&'a str);

impl<'a> NoUnicodeEscapes<'a> {
    /// `body`, when it holds no `\u`.
    #[must_use]
    pub fn check(body: &'a str) -> Option<Self> {
        memchr::memmem::find(body.as_bytes(), b"\\u")
            .is_none()
            .then_some(NoUnicodeEscapes(body))
    }

    /// The body.
    #[must_use]
    pub fn as_str(self) -> &'a str {
        self.0
    }
}

/// An Anthropic request body parsed with its strings borrowed, checked to be one the owned
/// path would translate without error (see the module docs for what is left to that path).
#[derive(Debug)]
pub struct AnthropicBody<'a> {
    req: Req<'a>,
    model: String,
    /// `output_config` and `output_format` as the owned request's `extra` holds them.
    extra: Map<String, Value>,
}

impl<'a> AnthropicBody<'a> {
    /// Parses and checks `body`; `None` when the owned path must take it.
    pub fn parse(body: &'a str) -> Option<Self> {
        if has_lone_surrogate(body.as_bytes()) {
            return None;
        }
        Self::parse_with(body, false)
    }

    /// [`AnthropicBody::parse`], and `None` as well for a body whose top level holds a key
    /// twice (in any spelling: keys are compared unescaped). A caller that refuses such bodies
    /// before translating (the bridge splits the top level with `policy::sanitize::raw::parse`
    /// first) can take a body this accepts without that step: it is a JSON object with unique
    /// top-level keys.
    pub fn parse_unique_keys(body: &'a str) -> Option<Self> {
        if has_lone_surrogate(body.as_bytes()) {
            return None;
        }
        Self::parse_with(body, true)
    }

    /// [`AnthropicBody::parse_unique_keys`] for a body already searched for `\u` escapes
    /// (the bridge's URL-source pre-scan does): with none, it cannot hold a lone surrogate,
    /// and the body is not searched again.
    pub fn parse_unique_keys_checked(body: NoUnicodeEscapes<'a>) -> Option<Self> {
        Self::parse_with(body.0, true)
    }

    /// The parse itself; the caller has refused bodies with a lone surrogate.
    fn parse_with(body: &'a str, unique_keys: bool) -> Option<Self> {
        let req: Req<'a> = if unique_keys {
            let mut de = serde_json::Deserializer::from_str(body);
            let req = de.deserialize_map(UniqueKeys).ok()?;
            de.end().ok()?;
            req
        } else {
            serde_json::from_str(body).ok()?
        };
        let model = unescape(escaped(req.model)?)?.into_owned();
        let mut extra = Map::new();
        for (key, raw) in [
            ("output_config", req.output_config),
            ("output_format", req.output_format),
        ] {
            if let Some(raw) = raw {
                extra.insert(key.to_owned(), serde_json::from_str(raw.get()).ok()?);
            }
        }
        for tool in req.tools.iter().flatten() {
            // `name` defaults to "" but may not be null; `description` may.
            let name_ok = tool
                .name
                .is_none_or(|n| escaped(n).and_then(unescape).is_some());
            if !name_ok || !is_string_or_null(tool.description) {
                return None;
            }
        }
        if let Some(system) = &req.system
            && !system_ok(system)
        {
            return None;
        }
        for m in &req.messages {
            if !message_ok(m) {
                return None;
            }
        }
        Some(Self { req, model, extra })
    }

    /// The `model` the client asked for (unescaped).
    pub fn model(&self) -> &str {
        &self.model
    }

    /// Whether the client asked for a stream.
    pub fn stream(&self) -> bool {
        self.req.stream == Some(true)
    }

    /// [`ResponseOptions::for_request`] of the owned request.
    pub fn response_options(&self) -> ResponseOptions {
        let mut tool_names = ToolNames::default();
        for tool in self.req.tools.iter().flatten() {
            tool_names.add(&tool_name(tool));
        }
        for m in &self.req.messages {
            if let Content::List(blocks) = &m.content {
                for b in blocks {
                    if let Some(Kind::ToolUse { name, .. }) = b.kind()
                        && let Some(name) = unescape(name)
                    {
                        tool_names.add(&name);
                    }
                }
            }
        }
        ResponseOptions {
            model: Some(self.model.clone()),
            message_id: None,
            tool_names,
            stop_sequences: self.req.stop_sequences.clone().unwrap_or_default(),
            input_tokens_estimate: 0,
        }
    }

    /// The chat body [`super::anthropic_into_chat`] would produce, serialized; with
    /// `default_temperature` set where the request has none (the blackbox proxy's policy).
    pub fn write_chat(&self, opts: &ChatOptions, default_temperature: Option<&Number>) -> Vec<u8> {
        let mut out = Vec::new();
        self.write_chat_into(opts, default_temperature, &mut out);
        out
    }

    /// [`AnthropicBody::write_chat`] into `out` (emptied first), so a caller can write into a
    /// buffer it reuses; [`AnthropicBody::chat_size_hint`] is the capacity it will want.
    pub fn write_chat_into(
        &self,
        opts: &ChatOptions,
        default_temperature: Option<&Number>,
        out: &mut Vec<u8>,
    ) {
        out.clear();
        out.reserve(self.chat_size_hint());
        // An empty vector is valid UTF-8; the writer appends only `str`s.
        let mut w = Writer {
            out: String::from_utf8(std::mem::take(out)).unwrap_or_default(),
        };
        w.request(self, opts, default_temperature);
        *out = w.out.into_bytes();
    }

    /// About the size of the chat body: the strings that make up most of it, plus room for
    /// the syntax around them.
    pub fn chat_size_hint(&self) -> usize {
        let mut n = 4096 + self.req.model.get().len();
        let content = |c: &Content<'_>| -> usize {
            match c {
                Content::Text(t) => t.len() + 64,
                Content::List(blocks) => blocks.iter().map(block_size).sum(),
            }
        };
        n += self.req.system.as_ref().map_or(0, content);
        n += self
            .req
            .messages
            .iter()
            .map(|m| content(&m.content) + 64)
            .sum::<usize>();
        for t in self.req.tools.iter().flatten() {
            n += 128
                + t.description.map_or(0, |d| d.get().len())
                + t.input_schema.map_or(0, |s| s.get().len())
                + t.name.map_or(0, |s| s.get().len());
        }
        n
    }
}

fn block_size(b: &Block<'_>) -> usize {
    let raw = |r: Option<&RawValue>| r.map_or(0, |r| r.get().len());
    let content = match &b.content {
        Some(Content::Text(t)) => t.len(),
        Some(Content::List(inner)) => inner.iter().map(block_size).sum(),
        None => 0,
    };
    // Arguments are escaped once more inside their string.
    64 + raw(b.text) + raw(b.id) + raw(b.name) + raw(b.input) * 9 / 8 + raw(b.thinking) + content
}

fn tool_name<'t>(tool: &'t ToolDef<'_>) -> Cow<'t, str> {
    tool.name
        .and_then(escaped)
        .and_then(unescape)
        .unwrap_or(Cow::Borrowed(""))
}

/// A system prompt this path takes: text blocks only (others the owned path ignores after
/// parsing them, which is left to it).
fn system_ok(c: &Content<'_>) -> bool {
    match c {
        Content::Text(_) => true,
        Content::List(blocks) => blocks
            .iter()
            .all(|b| matches!(b.kind(), Some(Kind::Text(_)))),
    }
}

fn message_ok(m: &Msg<'_>) -> bool {
    let blocks = match (&m.role, &m.content) {
        (Role::System, _) => return false,
        (_, Content::Text(_)) => return true,
        (_, Content::List(blocks)) => blocks,
    };
    blocks.iter().all(|b| match (m.role, b.kind()) {
        (_, None) => false,
        (Role::User, Some(Kind::ToolUse { .. })) => false,
        (Role::Assistant, Some(Kind::ToolResult { .. })) => false,
        (_, Some(Kind::ToolResult { content, .. })) => content.is_none_or(tool_result_ok),
        (_, Some(Kind::Text(_) | Kind::ToolUse { .. } | Kind::Thinking(_))) => true,
        (_, Some(Kind::RedactedThinking | Kind::Unknown)) => true,
    })
}

/// A tool result's content: every block well formed, nested results included.
fn tool_result_ok(c: &Content<'_>) -> bool {
    match c {
        Content::Text(_) => true,
        Content::List(blocks) => blocks.iter().all(|b| match b.kind() {
            None => false,
            Some(Kind::ToolResult { content, .. }) => content.is_none_or(tool_result_ok),
            Some(_) => true,
        }),
    }
}

/// Whether `body` may hold a `\u` escape of a surrogate that is not half of a pair. Every real
/// escape is found; an escaped backslash before a `u` may be taken for one, which only sends a
/// body to the owned path.
fn has_lone_surrogate(body: &[u8]) -> bool {
    let hex = |at: usize| -> Option<u16> {
        let digits = body.get(at..at + 4)?;
        u16::from_str_radix(std::str::from_utf8(digits).ok()?, 16).ok()
    };
    // Past the low half of the last pair.
    let mut paired_to = 0;
    for at in memchr::memmem::find_iter(body, b"\\u") {
        if at < paired_to {
            continue;
        }
        match hex(at + 2) {
            Some(0xd800..=0xdbff) => {
                let low = body.get(at + 6..at + 8) == Some(b"\\u".as_slice())
                    && hex(at + 8).is_some_and(|c| (0xdc00..=0xdfff).contains(&c));
                if !low {
                    return true;
                }
                paired_to = at + 12;
            }
            Some(0xdc00..=0xdfff) => return true,
            Some(_) | None => {}
        }
    }
    false
}

/// The chat body's writer: JSON text appended to one buffer.
struct Writer {
    out: String,
}

/// A JSON value written by serde_json (the short, rare members: same bytes as the owned path).
fn json_of<T: serde::Serialize + ?Sized>(out: &mut String, v: &T) {
    // These types (numbers, strings, owned chat types of `String`s and `Value`s) always
    // serialize.
    if let Ok(s) = serde_json::to_string(v) {
        out.push_str(&s);
    }
}

impl Writer {
    fn raw(&mut self, s: &str) {
        self.out.push_str(s);
    }

    /// A JSON string from its escaped pieces.
    fn string(&mut self, pieces: &[&str]) {
        self.out.push('"');
        for p in pieces {
            self.out.push_str(p);
        }
        self.out.push('"');
    }

    fn key(&mut self, first: &mut bool, key: &str) {
        if !*first {
            self.out.push(',');
        }
        *first = false;
        self.out.push('"');
        self.out.push_str(key);
        self.out.push_str("\":");
    }

    fn request(&mut self, body: &AnthropicBody<'_>, opts: &ChatOptions, temp: Option<&Number>) {
        let req = &body.req;
        self.raw("{\"model\":");
        match &opts.model {
            Some(m) => json_of(&mut self.out, m),
            None => self.raw(req.model.get()),
        }
        self.raw(",\"messages\":[");
        let mut messages = Messages {
            w: self,
            first: true,
        };
        if let Some(system) = &req.system {
            messages.system(system, opts);
        }
        for m in &req.messages {
            match m.role {
                Role::User => messages.user(&m.content),
                Role::Assistant => messages.assistant(&m.content, opts),
                // Refused by `parse`: folding them is the owned path's.
                Role::System => {}
            }
        }
        self.raw("]");

        let mut first = false;
        let (max_tokens, max_completion_tokens) = opts.anthropic_output_limit(req.max_tokens);
        if let Some(n) = max_tokens {
            self.key(&mut first, "max_tokens");
            let _ = write!(self.out, "{n}");
        }
        if let Some(n) = max_completion_tokens {
            self.key(&mut first, "max_completion_tokens");
            let _ = write!(self.out, "{n}");
        }
        if let Some(stop) = req.stop_sequences.as_ref().filter(|s| !s.is_empty()) {
            self.key(&mut first, "stop");
            json_of(&mut self.out, stop);
        }
        if let Some(stream) = req.stream {
            self.key(&mut first, "stream");
            self.raw(if stream { "true" } else { "false" });
        }
        if stream_opts(body.stream(), opts) {
            self.key(&mut first, "stream_options");
            json_of(
                &mut self.out,
                &StreamOptions {
                    include_usage: Some(true),
                    extra: Map::new(),
                },
            );
        }
        if let Some(t) = req.temperature.as_ref().or(temp) {
            self.key(&mut first, "temperature");
            json_of(&mut self.out, t);
        }
        if let Some(p) = &req.top_p {
            self.key(&mut first, "top_p");
            json_of(&mut self.out, p);
        }
        let names = self.tools(req, &mut first);
        let (tool_choice, parallel) =
            match super::request::translate_tool_choice(req.tool_choice.clone()) {
                _ if names.is_empty() => (None, None),
                (Some(ChatToolChoice::Named(named)), _)
                    if !names.iter().any(|n| *n == named.function.name) =>
                {
                    (None, None)
                }
                other => other,
            };
        if let Some(choice) = &tool_choice {
            self.key(&mut first, "tool_choice");
            json_of(&mut self.out, choice);
        }
        if let Some(p) = parallel {
            self.key(&mut first, "parallel_tool_calls");
            self.raw(if p { "true" } else { "false" });
        }
        if opts.forward_user
            && let Some(user) = req.metadata.as_ref().and_then(|m| m.user_id.as_ref())
        {
            self.key(&mut first, "user");
            json_of(&mut self.out, user);
        }
        let (effort, reasoning) = super::reasoning_fields(
            opts.reasoning,
            super::request::thinking_effort(req.thinking.as_ref(), &body.extra),
        );
        if let Some(e) = &effort {
            self.key(&mut first, "reasoning_effort");
            json_of(&mut self.out, e);
        }
        if let Some(r) = &reasoning {
            self.key(&mut first, "reasoning");
            json_of(&mut self.out, r);
        }
        if let Some(f) = super::request::response_format(&body.extra) {
            self.key(&mut first, "response_format");
            json_of(&mut self.out, &f);
        }
        if opts.forward_top_k
            && let Some(k) = req.top_k
        {
            self.key(&mut first, "top_k");
            let _ = write!(self.out, "{k}");
        }
        self.raw("}");
    }

    /// The client tools as functions; returns their upstream names (for the tool choice).
    fn tools<'t>(&mut self, req: &'t Req<'_>, first: &mut bool) -> Vec<Cow<'t, str>> {
        let mut names = Vec::new();
        for tool in req.tools.iter().flatten().filter(|t| !t.is_server_tool()) {
            if names.is_empty() {
                self.key(first, "tools");
                self.raw("[");
            } else {
                self.raw(",");
            }
            let name = match tool_name(tool) {
                Cow::Borrowed(n) => upstream_tool_name(n),
                Cow::Owned(n) => Cow::Owned(upstream_tool_name(&n).into_owned()),
            };
            self.raw("{\"type\":\"function\",\"function\":{\"name\":");
            json_of(&mut self.out, name.as_ref());
            if let Some(d) = tool.description.and_then(escaped) {
                self.raw(",\"description\":");
                self.string(&[d]);
            }
            self.raw(",\"parameters\":");
            match tool.input_schema {
                Some(s) => self.raw(s.get()),
                None => self.raw(super::empty_schema().get()),
            }
            match tool.strict.map(RawValue::get) {
                Some("true") => self.raw(",\"strict\":true"),
                Some("false") => self.raw(",\"strict\":false"),
                Some(_) | None => {}
            }
            self.raw("}}");
            names.push(name);
        }
        if !names.is_empty() {
            self.raw("]");
        }
        names
    }
}

fn stream_opts(streaming: bool, opts: &ChatOptions) -> bool {
    streaming && opts.include_usage
}

/// The `messages` array being written.
struct Messages<'w> {
    w: &'w mut Writer,
    first: bool,
}

impl Messages<'_> {
    fn open(&mut self, role: &str) {
        if !self.first {
            self.w.out.push(',');
        }
        self.first = false;
        self.w.raw("{\"role\":\"");
        self.w.raw(role);
        self.w.raw("\"");
    }

    fn system(&mut self, system: &Content<'_>, opts: &ChatOptions) {
        let billing = |t: &str| opts.strip_billing_header && starts_with(t, BILLING_HEADER_PREFIX);
        let mut pieces: Vec<&str> = Vec::new();
        match system {
            Content::Text(t) => {
                if !t.is_empty() && !billing(t) {
                    pieces.push(t);
                }
            }
            Content::List(blocks) => {
                for b in blocks {
                    if let Some(Kind::Text(t)) = b.kind()
                        && !t.is_empty()
                        && !billing(t)
                    {
                        if !pieces.is_empty() {
                            pieces.push("\\n\\n");
                        }
                        pieces.push(t);
                    }
                }
            }
        }
        if pieces.is_empty() {
            return;
        }
        self.open("system");
        self.w.raw(",\"content\":");
        self.w.string(&pieces);
        self.w.raw("}");
    }

    /// A user turn: its tool results as tool messages first, then the rest of it.
    fn user(&mut self, content: &Content<'_>) {
        let blocks = match content {
            Content::Text(t) => {
                self.open("user");
                self.w.raw(",\"content\":");
                self.w.string(&[t]);
                self.w.raw("}");
                return;
            }
            Content::List(blocks) => blocks,
        };
        let mut own: Vec<&str> = Vec::new();
        for b in blocks {
            match b.kind() {
                Some(Kind::ToolResult {
                    tool_use_id,
                    content,
                }) => {
                    self.open("tool");
                    self.w.raw(",\"tool_call_id\":");
                    self.w.string(&[tool_use_id]);
                    self.w.raw(",\"content\":");
                    self.tool_result(content);
                    self.w.raw("}");
                }
                Some(Kind::Text(t)) => {
                    if !t.is_empty() {
                        own.push(t);
                    }
                }
                // Thinking in a user turn and unknown blocks have no chat meaning; the rest
                // `parse` left to the owned path.
                Some(
                    Kind::Thinking(_)
                    | Kind::RedactedThinking
                    | Kind::Unknown
                    | Kind::ToolUse { .. },
                )
                | None => {}
            }
        }
        match own.as_slice() {
            [] => {}
            [one] => {
                self.open("user");
                self.w.raw(",\"content\":");
                self.w.string(&[one]);
                self.w.raw("}");
            }
            parts => {
                self.open("user");
                self.w.raw(",\"content\":[");
                for (i, t) in parts.iter().enumerate() {
                    if i > 0 {
                        self.w.raw(",");
                    }
                    self.w.raw("{\"type\":\"text\",\"text\":");
                    self.w.string(&[t]);
                    self.w.raw("}");
                }
                self.w.raw("]}");
            }
        }
    }

    /// A tool result's content as one string: its text blocks joined by line breaks.
    fn tool_result(&mut self, content: Option<&Content<'_>>) {
        let blocks = match content {
            None => return self.w.raw("\"\""),
            Some(Content::Text(t)) => return self.w.string(&[t]),
            Some(Content::List(blocks)) => blocks,
        };
        let mut pieces: Vec<&str> = Vec::with_capacity(blocks.len() * 2);
        let mut any = false;
        for b in blocks {
            if let Some(Kind::Text(t)) = b.kind() {
                if any && !t.is_empty() {
                    pieces.push("\\n");
                }
                any |= !t.is_empty();
                pieces.push(t);
            }
        }
        self.w.string(&pieces);
    }

    /// An assistant turn: always one chat message.
    fn assistant(&mut self, content: &Content<'_>, opts: &ChatOptions) {
        let mut text: Vec<&str> = Vec::new();
        let mut reasoning: Vec<&str> = Vec::new();
        let mut calls: Vec<(&str, &str, &RawValue)> = Vec::new();
        match content {
            Content::Text(t) => text.push(t),
            Content::List(blocks) => {
                for b in blocks {
                    match b.kind() {
                        Some(Kind::Text(t)) => text.push(t),
                        Some(Kind::Thinking(t)) => {
                            if opts.reasoning_passback {
                                reasoning.push(t);
                            }
                        }
                        Some(Kind::ToolUse { id, name, input }) => calls.push((id, name, input)),
                        Some(Kind::RedactedThinking | Kind::Unknown | Kind::ToolResult { .. })
                        | None => {}
                    }
                }
            }
        }
        self.open("assistant");
        self.w.raw(",\"content\":");
        let has_text = text.iter().any(|t| !t.is_empty());
        if has_text || calls.is_empty() {
            self.w.string(&text);
        } else {
            self.w.raw("null");
        }
        if !calls.is_empty() {
            self.w.raw(",\"tool_calls\":[");
            for (i, (id, name, input)) in calls.iter().enumerate() {
                if i > 0 {
                    self.w.raw(",");
                }
                self.w.raw("{\"id\":");
                self.w.string(&[id]);
                self.w.raw(",\"type\":\"function\",\"function\":{\"name\":");
                match unescape(name) {
                    Some(n) => json_of(&mut self.w.out, upstream_tool_name(&n).as_ref()),
                    None => self.w.string(&[name]),
                }
                self.w.raw(",\"arguments\":");
                self.w.arguments(input);
                self.w.raw("}}");
            }
            self.w.raw("]");
        }
        if reasoning.iter().any(|r| !r.is_empty()) {
            self.w.raw(",\"reasoning_content\":");
            self.w.string(&reasoning);
        }
        self.w.raw("}");
    }
}

impl Writer {
    /// A tool call's input as its `arguments` string: a string input is arguments that were
    /// not valid JSON, kept verbatim; anything else its JSON text, which is the raw text when
    /// that is how serde_json writes it (compact, no `\u` or `\/` escapes, no floats), else the
    /// parsed value written again as the owned path writes it.
    fn arguments(&mut self, input: &RawValue) {
        let raw = input.get();
        if raw.starts_with('"') {
            return self.raw(raw);
        }
        self.out.push('"');
        if is_canonical(raw) {
            escape_into(&mut self.out, raw);
        } else {
            // `parse` checked the syntax; a number out of range is the one thing that fails
            // here, and the owned path refuses that request.
            let text = serde_json::from_str::<Value>(raw)
                .map_or_else(|_| raw.to_owned(), |v| v.to_string());
            escape_into(&mut self.out, &text);
        }
        self.out.push('"');
    }
}

/// Whether serde_json would write the JSON text `raw` back byte for byte: no whitespace
/// between tokens, strings without `\u` or `\/` escapes, numbers integers of at most 15
/// digits (`-0` excepted). Duplicate keys are kept as written (a `Value` keeps the last).
fn is_canonical(raw: &str) -> bool {
    let b = raw.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'"' => {
                i += 1;
                loop {
                    match b.get(i) {
                        None => return false,
                        Some(b'"') => break,
                        Some(b'\\') => {
                            if matches!(b.get(i + 1), Some(b'u' | b'/') | None) {
                                return false;
                            }
                            i += 2;
                        }
                        Some(_) => i += 1,
                    }
                }
                i += 1;
            }
            b'-' | b'0'..=b'9' => {
                let start = i;
                if b[i] == b'-' {
                    i += 1;
                }
                let digits = i;
                while i < b.len() && b[i].is_ascii_digit() {
                    i += 1;
                }
                let n = i - digits;
                if n == 0 || n > 15 || (b[start] == b'-' && b.get(digits) == Some(&b'0')) {
                    return false;
                }
                if matches!(b.get(i), Some(b'.' | b'e' | b'E')) {
                    return false;
                }
            }
            b'{' | b'}' | b'[' | b']' | b':' | b',' => i += 1,
            b't' | b'f' | b'n' => {
                let word: &[u8] = match b[i] {
                    b't' => b"true",
                    b'f' => b"false",
                    _ => b"null",
                };
                if !b[i..].starts_with(word) {
                    return false;
                }
                i += word.len();
            }
            _ => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::anthropic::MessagesRequest;
    use crate::translate::MaxTokensField;
    use crate::translate::anthropic_into_chat;
    use serde_json::json;

    /// The owned path's chat request for `body`, as JSON, or its error.
    fn owned(body: &str, opts: &ChatOptions) -> Result<Value, String> {
        let req: MessagesRequest = serde_json::from_str(body).map_err(|e| e.to_string())?;
        let chat = anthropic_into_chat(req, opts).map_err(|e| e.to_string())?;
        Ok(serde_json::to_value(chat).unwrap())
    }

    /// The borrowed path's chat body for `body`, parsed back, when it takes the body.
    fn borrowed(body: &str, opts: &ChatOptions) -> Option<Value> {
        let unique = AnthropicBody::parse_unique_keys(body).map(|b| b.write_chat(opts, None));
        // Past the bridge's one search for `\u`, the parse that skips its own takes the same.
        match NoUnicodeEscapes::check(body) {
            Some(checked) => assert_eq!(
                AnthropicBody::parse_unique_keys_checked(checked).map(|b| b.write_chat(opts, None)),
                unique,
                "{body}"
            ),
            None => assert!(body.contains("\\u"), "{body}"),
        }
        let parsed = AnthropicBody::parse(body);
        assert_eq!(
            unique,
            parsed.as_ref().map(|b| b.write_chat(opts, None)),
            "{body}"
        );
        let parsed = parsed?;
        let bytes = parsed.write_chat(opts, None);
        // Into a reused buffer (what the bridge does with its pooled ones): the same bytes,
        // nothing of what the buffer held before.
        let mut reused = b"{\"left\": \"over\"}".repeat(64);
        parsed.write_chat_into(opts, None, &mut reused);
        assert_eq!(reused, bytes, "{body}");
        Some(serde_json::from_slice(&bytes).expect("the borrowed path writes JSON"))
    }

    fn options() -> [ChatOptions; 3] {
        [
            ChatOptions::default(),
            ChatOptions {
                model: Some("up\"stream".into()),
                max_output_tokens: Some(100),
                max_tokens_field: MaxTokensField::Both,
                reasoning: super::super::ReasoningField::Reasoning,
                forward_user: true,
                forward_top_k: true,
                reasoning_passback: false,
                strip_billing_header: false,
                ..ChatOptions::default()
            },
            ChatOptions {
                max_tokens_field: MaxTokensField::MaxTokens,
                include_usage: false,
                reasoning: super::super::ReasoningField::ReasoningEffort,
                ..ChatOptions::default()
            },
        ]
    }

    #[test]
    fn unique_keys_refuses_a_repeated_top_level_key() {
        let msgs = r#""messages":[{"role":"user","content":"hi"}]"#;
        for body in [
            format!(r#"{{"model":"m",{msgs},"x":1,"x":2}}"#),
            format!(r#"{{"model":"m",{msgs},"mo\u0064el":"n"}}"#),
            format!(r#"{{"model":"m",{msgs},"z\u0031":1,"z1":2}}"#),
        ] {
            assert!(AnthropicBody::parse_unique_keys(&body).is_none(), "{body}");
        }
        // Unknown members once each, escaped keys, whitespace: taken, as `parse` takes them.
        let body =
            format!(r#" {{ "model" : "m\u0031" , {msgs}, "x":[1,{{"x":2}}], "y\u0031" : 1 }} "#);
        let b = AnthropicBody::parse_unique_keys(&body).expect("taken");
        assert_eq!(b.model(), "m1");
        assert!(AnthropicBody::parse_unique_keys("[1]").is_none());
    }

    /// Requests of the shapes the borrowed path takes, with the corners of each rule.
    fn cases() -> Vec<Value> {
        let long = "mcp__".to_owned() + &"server".repeat(12) + "__tool";
        vec![
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
            json!({"model": "m", "messages": [{"role": "user", "content": ""}], "stream": false}),
            json!({"model": "m", "max_tokens": 500, "stream": true, "temperature": 1, "top_p": 0.5,
                "top_k": 7, "stop_sequences": ["END", "x\ny"], "metadata": {"user_id": "u1", "z": 1},
                "system": "x-anthropic-billing-header: cc=1;",
                "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}),
            json!({"model": "m", "system": [
                    {"type": "text", "text": "x-anthropic-billing-header: cc=1;"},
                    {"type": "text", "text": ""},
                    {"type": "text", "text": "You are \"Claude\".\n", "cache_control": {"type": "ephemeral"}},
                    {"type": "text", "text": "second"}],
                "thinking": {"type": "enabled", "budget_tokens": 5000},
                "messages": [
                    {"role": "user", "content": [
                        {"type": "text", "text": "one"}, {"type": "text", "text": ""},
                        {"type": "thinking", "thinking": "t", "signature": null},
                        {"type": "search_result", "title": 5}, {"type": "text", "text": "two"}]},
                    {"role": "assistant", "content": [
                        {"type": "thinking", "thinking": "think \\ hard", "signature": "sig"},
                        {"type": "redacted_thinking", "data": "xx"},
                        {"type": "text", "text": "I will "}, {"type": "text", "text": "look."},
                        {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls \"a b\"", "n": [1, -2, true, null, {}]}},
                        {"type": "tool_use", "id": "toolu_2", "name": long, "input": "not json {"},
                        {"type": "tool_use", "id": "toolu_3", "name": "Read", "input": {}}]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "out\n"},
                        {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": true, "content": [
                            {"type": "text", "text": ""}, {"type": "text", "text": "l1"},
                            {"type": "tool_use", "id": "x", "name": "y", "input": {}},
                            {"type": "text", "text": ""}, {"type": "text", "text": "l2"}]},
                        {"type": "tool_result", "tool_use_id": "toolu_3"},
                        {"type": "text", "text": "next"}]},
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t4", "name": "Bash", "input": {"a": 1}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t4", "content": []}]},
                    {"role": "assistant", "content": ""},
                    {"role": "assistant", "content": []},
                    {"role": "assistant", "content": "plain"}],
                "tools": [
                    {"name": "Bash", "description": "Runs \"commands\".\n".repeat(40), "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}, "strict": true},
                    {"name": long, "cache_control": {"type": "ephemeral"}},
                    {"name": "web_search", "type": "web_search_20250305"},
                    {"name": "Read", "type": "custom", "description": null, "input_schema": null, "strict": "yes"}],
                "tool_choice": {"type": "tool", "name": long, "disable_parallel_tool_use": true},
                "context_management": {"edits": []}}),
            json!({"model": "m", "messages": [{"role": "user", "content": "q"}],
                "tools": [{"name": "A", "input_schema": {"type": "object"}}],
                "tool_choice": {"type": "tool", "name": "web_search"}}),
            json!({"model": "m", "messages": [{"role": "user", "content": "q"}],
                "tools": [{"name": "A"}], "tool_choice": {"type": "any", "disable_parallel_tool_use": true}}),
            json!({"model": "m", "messages": [{"role": "user", "content": "q"}],
                "tool_choice": {"type": "auto"}}),
            json!({"model": "m", "messages": [{"role": "user", "content": "q"}],
                "thinking": {"type": "adaptive"}, "output_config": {"effort": "max",
                "format": {"type": "json_schema", "schema": {"type": "object"}}}}),
            json!({"model": "m", "messages": [{"role": "user", "content": "q"}],
                "output_format": {"type": "json_schema", "schema": {"type": "object"}}, "output_config": null}),
        ]
    }

    #[test]
    fn agrees_with_the_owned_path() {
        for case in cases() {
            let compact = serde_json::to_string(&case).unwrap();
            let pretty = serde_json::to_string_pretty(&case).unwrap();
            for opts in options() {
                let want = owned(&compact, &opts).unwrap();
                for body in [&compact, &pretty] {
                    let got = borrowed(body, &opts).unwrap_or_else(|| panic!("not taken: {body}"));
                    assert_eq!(got, want, "{body}");
                }
            }
            let parsed = AnthropicBody::parse(&compact).unwrap();
            let req: MessagesRequest = serde_json::from_str(&compact).unwrap();
            assert_eq!(
                parsed.response_options(),
                ResponseOptions::for_request(&req)
            );
            assert_eq!(parsed.stream(), req.stream == Some(true));
        }
    }

    #[test]
    fn compact_bodies_come_out_byte_for_byte() {
        for case in cases() {
            let compact = serde_json::to_string(&case).unwrap();
            for opts in options() {
                let req: MessagesRequest = serde_json::from_str(&compact).unwrap();
                let want = serde_json::to_vec(&anthropic_into_chat(req, &opts).unwrap()).unwrap();
                let got = AnthropicBody::parse(&compact)
                    .unwrap()
                    .write_chat(&opts, None);
                assert_eq!(
                    String::from_utf8(got).unwrap(),
                    String::from_utf8(want).unwrap()
                );
            }
        }
    }

    #[test]
    fn escapes_survive_unchanged_in_meaning() {
        // As the client wrote them: a quote, a backslash, a line break, é escaped and an
        // emoji as a surrogate pair, in long and short strings, a tool input and a schema.
        let text = r#"say \"hi\" \\ path\\to\nnext \u00e9t\u00E9 \ud83d\ude00 \/ \t\b\f\u0001 end"#;
        let long = text.repeat(20);
        let body = format!(
            r#"{{"model":"m\u00e9","system":"{long}","messages":[
                {{"role":"user","content":"{text}"}},
                {{"role":"user","content":[{{"type":"text","text":"{long}"}}]}},
                {{"role":"assistant","content":[{{"type":"text","text":"{text}"}},
                  {{"type":"tool_use","id":"t1","name":"B\u0061sh","input":{{"q":"{text}","n":1.50}}}}]}},
                {{"role":"user","content":[{{"type":"tool_result","tool_use_id":"t1","content":"{long}"}}]}}],
              "tools":[{{"name":"B\u0061sh","description":"{long}","input_schema":{{"description":"{text}"}}}}]}}"#
        );
        let unescaped: String = serde_json::from_str(&format!("\"{text}\"")).unwrap();
        assert!(
            unescaped.contains("é") && unescaped.contains('😀') && unescaped.contains("\\to\n")
        );
        for opts in options() {
            let got = borrowed(&body, &opts).expect("taken");
            assert_eq!(got, owned(&body, &opts).unwrap());
            assert_eq!(got["messages"][1]["content"], json!(unescaped));
            assert_eq!(got["messages"][4]["content"], json!(unescaped.repeat(20)));
            let args: Value = serde_json::from_str(
                got["messages"][3]["tool_calls"][0]["function"]["arguments"]
                    .as_str()
                    .unwrap(),
            )
            .unwrap();
            assert_eq!(args, json!({"q": unescaped, "n": 1.5}));
            assert_eq!(got["tools"][0]["function"]["name"], "Bash");
        }
        let parsed = AnthropicBody::parse(&body).unwrap();
        assert_eq!(parsed.response_options().model.as_deref(), Some("mé"));
    }

    #[test]
    fn invalid_escapes_and_lone_surrogates_go_to_the_owned_path_which_refuses_them() {
        let opts = ChatOptions::default();
        for bad in [
            r#""\ud800""#,
            r#""a \udc00 b""#,
            r#""\ud83d\u0041""#,
            r#""\ud83d""#,
            r#""\x41""#,
            r#""\u12""#,
            "\"tab\tinside\"",
        ] {
            for body in [
                format!(r#"{{"model":"m","messages":[{{"role":"user","content":{bad}}}]}}"#),
                format!(
                    r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"text","text":{bad}}}]}}]}}"#
                ),
                format!(
                    r#"{{"model":"m","messages":[{{"role":"assistant","content":[{{"type":"tool_use","id":"t","name":"n","input":{{"a":{bad}}}}}]}}]}}"#
                ),
                format!(r#"{{"model":"m","unknown":{{"x":[{bad}]}},"messages":[]}}"#),
            ] {
                assert!(AnthropicBody::parse(&body).is_none(), "taken: {body}");
                assert!(owned(&body, &opts).is_err(), "owned path took: {body}");
            }
        }
        // An escaped backslash before `ud800` is text, not an escape: both paths take it.
        let body = r#"{"model":"m","messages":[{"role":"user","content":"\\ud800"}]}"#;
        assert_eq!(
            owned(body, &opts).unwrap()["messages"][0]["content"],
            "\\ud800"
        );
    }

    #[test]
    fn what_it_leaves_to_the_owned_path() {
        let url = json!({"type": "url", "url": "https://x/a.png"});
        for case in [
            json!({"model": "m", "messages": [{"role": "system", "content": "s"}]}),
            json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "image", "source": url}]}]}),
            json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]}),
            json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "n", "input": {}}]}]}),
            json!({"model": "m", "messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]}),
            json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}]}]}),
            json!({"model": "m", "system": [{"type": "image", "source": url}], "messages": []}),
            json!({"model": "m", "tools": [{"name": null}], "messages": []}),
            json!({"model": 5, "messages": []}),
            json!({"messages": []}),
        ] {
            let body = case.to_string();
            assert!(AnthropicBody::parse(&body).is_none(), "taken: {body}");
        }
        assert!(AnthropicBody::parse("[]").is_none());
        assert!(AnthropicBody::parse("{\"model\":\"m\",\"messages\":[]").is_none());
    }

    #[test]
    fn canonical_is_what_serde_json_writes_back() {
        for raw in [
            r#"{"a":1,"b":[true,false,null],"c":{"d":"x\"y\\n"}}"#,
            r#"{"a": 1}"#,
            r#"{"a":1.5}"#,
            r#"{"a":1e3}"#,
            r#"{"a":-0}"#,
            r#"{"a":-12}"#,
            r#"{"a":"\u00e9"}"#,
            r#"{"a":"\/"}"#,
            r#"{"a":12345678901234567890}"#,
            "[]",
        ] {
            let v: Value = serde_json::from_str(raw).unwrap();
            if is_canonical(raw) {
                assert_eq!(v.to_string(), raw);
            }
        }
        assert!(is_canonical(
            r#"{"a":1,"b":[true,false,null],"c":{"d":"x\"y\\n"}}"#
        ));
        assert!(!is_canonical(r#"{"a": 1}"#));
    }

    #[test]
    fn default_temperature_fills_only_an_absent_one() {
        let t = Number::from_f64(0.7).unwrap();
        let opts = ChatOptions::default();
        let body = r#"{"model":"m","messages":[]}"#;
        let got = AnthropicBody::parse(body)
            .unwrap()
            .write_chat(&opts, Some(&t));
        let v: Value = serde_json::from_slice(&got).unwrap();
        assert_eq!(v["temperature"], json!(0.7));
        let body = r#"{"model":"m","messages":[],"temperature":0}"#;
        let got = AnthropicBody::parse(body)
            .unwrap()
            .write_chat(&opts, Some(&t));
        let v: Value = serde_json::from_slice(&got).unwrap();
        assert_eq!(v["temperature"], json!(0));
    }
}
