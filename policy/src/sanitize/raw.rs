//! The sanitizer without a `serde_json::Value` tree: what the gateway and the bridge run on
//! every Anthropic passthrough request. Same rules as [`super::sanitize_request`] (which stays
//! as the reference the golden tests compare with), same output for a compact body, a
//! fraction of the work.
//!
//! [`parse`] splits the body's top level into its members, in order, each kept as the raw
//! text of the body (`&RawValue`), a duplicate top-level key refused. [`Request::sanitize`]
//! then walks every member once, without building anything: every object at any depth is
//! checked for duplicate keys, `system` and `messages` for media with URL sources (unless
//! allowed), and the input-token estimate is counted in the same walk. Only what must change
//! is written anew (the model, a capped `max_tokens`, a `tools` list that lost a server tool,
//! `metadata` without `user_id`); every other member is copied as its raw text.
//!
//! [`sanitize`] does both steps in one scan for a caller that knows its [`Options`] before the
//! body (the gateway): the members are walked while the top level is read, and each one's raw
//! text is found from where the body lends its key; whatever it cannot take that way, and every
//! refusal, goes through the two steps, so answers and errors are theirs. The `_to_pieces`
//! variants give the body to send as [`Pieces`]: spans of the client's body and the few bytes
//! written anew, which a proxy holding the client's body as shared bytes sends without copying
//! the untouched members into a new buffer.
//!
//! Why duplicates are refused at every depth: a member we do not edit goes upstream as the
//! client's bytes. A parser that keeps the first of two duplicate keys (ours keeps none: we
//! refuse) would otherwise see a value nobody checked, say a tool whose first `type` is
//! `web_search_*` and whose second is `custom`, or an image whose first `source` is a URL.
//! With duplicates refused, every member has one meaning, and it is the one we checked.
//!
//! The estimate follows the gateway's rules (`gateway/src/estimate.rs`, which owns the
//! constants and passes them in [`EstimateRules`]): where it counts a value's JSON, this
//! counts the length serde_json would write for it, so the number is the one the tree-based
//! estimate gives on the sanitized request.

use std::borrow::Cow;
use std::collections::HashSet;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

use super::{REMOVED_FIELDS, RemovedTool, Report, SanitizeError};

/// The constants of the input-token estimate (the gateway's `estimate` module owns them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EstimateRules {
    /// Tokens per image block.
    pub image_tokens: u64,
    /// Least tokens per document with inline (or unknown) data.
    pub document_min_tokens: u64,
    /// Tokens per document with a URL source.
    pub url_document_tokens: u64,
    /// Framing tokens per message.
    pub message_overhead: u64,
    /// Bytes of text per token (at least 1).
    pub bytes_per_token: u64,
}

/// What to do to a request.
#[derive(Debug, Clone, Copy)]
pub struct Options<'o> {
    /// The upstream's model name, written as `model`.
    pub model: &'o str,
    /// The model's `allow_url_sources`: media with URL sources pass.
    pub allow_url_sources: bool,
    /// The catalogue's output limit: a valid `max_tokens` above it is written as the cap.
    pub max_tokens_cap: Option<u64>,
    /// Remove `metadata.user_id` (the bridge, unless the model forwards it).
    pub strip_metadata_user_id: bool,
    /// Count the input-token estimate with these rules.
    pub estimate: Option<EstimateRules>,
}

/// The request's `max_tokens`, after the cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaxTokens {
    /// Absent.
    Missing,
    /// Present but not a positive integer.
    Invalid,
    /// A positive integer (the cap when it was above it).
    Value(u64),
}

/// A sanitized request; its body written out (`Vec<u8>`) or as [`Pieces`].
#[derive(Debug)]
pub struct Sanitized<B = Vec<u8>> {
    /// The body to send upstream.
    pub body: B,
    /// What was removed.
    pub report: Report,
    /// The `max_tokens` sent.
    pub max_tokens: MaxTokens,
    /// The input-token estimate of the body sent (0 unless [`Options::estimate`] was given).
    pub input_tokens: u64,
}

/// A body to send as the pieces it is made of, in order: spans of the client's body (the
/// members sent as the client wrote them) and bytes written anew (keys, separators, edited
/// members), so a caller holding the client's body as shared bytes sends it without copying
/// it. Every [`Span::Body`] lies within the client's body and every [`Span::Written`] within
/// what was written anew ([`Pieces::into_parts`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pieces {
    /// Everything written anew, one piece after the other.
    written: Vec<u8>,
    /// The body, in order.
    spans: Vec<Span>,
}

/// One piece of [`Pieces`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Span {
    /// These bytes of the client's body.
    Body(std::ops::Range<usize>),
    /// These bytes of what was written anew.
    Written(std::ops::Range<usize>),
}

impl Pieces {
    /// The body, in order.
    pub fn spans(&self) -> &[Span] {
        &self.spans
    }

    /// What was written anew (the bytes [`Span::Written`] points into) and the spans.
    pub fn into_parts(self) -> (Vec<u8>, Vec<Span>) {
        (self.written, self.spans)
    }

    /// The body's length.
    pub fn len(&self) -> usize {
        self.spans
            .iter()
            .map(|s| match s {
                Span::Body(r) | Span::Written(r) => r.len(),
            })
            .sum()
    }

    /// Whether the body is empty (never, for a sanitized request).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The body written out, `client` being the client's body the pieces were cut from.
    pub fn to_vec(&self, client: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.len());
        for s in &self.spans {
            let piece = match s {
                Span::Body(r) => client.get(r.clone()),
                Span::Written(r) => self.written.get(r.clone()),
            };
            out.extend_from_slice(piece.unwrap_or_default());
        }
        out
    }
}

/// Where the body to send is written: [`finish`] writes the new bytes and hands over the
/// client's members to copy.
trait Sink {
    /// Bytes written anew.
    fn put(&mut self, bytes: &[u8]);
    /// A raw text of the client's body, sent as it is.
    fn copy(&mut self, raw: &str);
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
    fn copy(&mut self, raw: &str) {
        self.extend_from_slice(raw.as_bytes());
    }
}

/// Builds [`Pieces`] cut from the client's body at `base` (its address), `len` bytes long.
struct PieceSink {
    base: usize,
    len: usize,
    pieces: Pieces,
}

impl PieceSink {
    fn new(body: &[u8]) -> Self {
        PieceSink {
            base: body.as_ptr().addr(),
            len: body.len(),
            pieces: Pieces {
                written: Vec::with_capacity(256),
                spans: Vec::with_capacity(48),
            },
        }
    }
}

impl Sink for PieceSink {
    fn put(&mut self, bytes: &[u8]) {
        let w = &mut self.pieces.written;
        let (from, to) = (w.len(), w.len() + bytes.len());
        w.extend_from_slice(bytes);
        match self.pieces.spans.last_mut() {
            Some(Span::Written(r)) if r.end == from => r.end = to,
            Some(Span::Written(_) | Span::Body(_)) | None => {
                self.pieces.spans.push(Span::Written(from..to));
            }
        }
    }
    fn copy(&mut self, raw: &str) {
        // The raw texts [`finish`] copies are slices of the client's body; anything else
        // (there is nothing else) would be written out.
        let at = raw
            .as_ptr()
            .addr()
            .checked_sub(self.base)
            .filter(|at| at + raw.len() <= self.len);
        let Some(at) = at else {
            return self.put(raw.as_bytes());
        };
        let end = at + raw.len();
        match self.pieces.spans.last_mut() {
            Some(Span::Body(r)) if r.end == at => r.end = end,
            Some(Span::Body(_) | Span::Written(_)) | None => {
                self.pieces.spans.push(Span::Body(at..end));
            }
        }
    }
}

/// `io::Write` over a [`Sink`], for serde_json's writers (writing into memory cannot fail).
struct Put<'s, S>(&'s mut S);

impl<S: Sink> std::io::Write for Put<'_, S> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.put(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A request body split at its top level: each member's key and raw text, in order.
#[derive(Debug)]
pub struct Request<'a> {
    members: Vec<(Cow<'a, str>, &'a RawValue)>,
    body: &'a [u8],
}

/// Splits a body into its top-level members. Refuses what is not JSON, what is not an object
/// and a duplicate top-level key. Nested objects are checked by [`Request::sanitize`].
pub fn parse(body: &[u8]) -> Result<Request<'_>, SanitizeError> {
    let Ok(text) = simdutf8::basic::from_utf8(body) else {
        // serde_json refuses invalid UTF-8 too; its error says where.
        return Err(match serde_json::from_slice::<IgnoredAny>(body) {
            Err(e) => SanitizeError::Json(e),
            Ok(_) => SanitizeError::Json(de::Error::custom("request body is not UTF-8")),
        });
    };
    let mut de = serde_json::Deserializer::from_str(text);
    let mut dup = false;
    let top = de
        .deserialize_any(TopVisitor { dup: &mut dup })
        .map_err(|e| keyed_error(e, dup))?;
    de.end()?;
    match top {
        Top::Object(members) => Ok(Request { members, body }),
        Top::Other(found) => Err(SanitizeError::NotAnObject { found }),
    }
}

fn keyed_error(e: serde_json::Error, duplicate: bool) -> SanitizeError {
    if duplicate {
        SanitizeError::DuplicateKey(e)
    } else {
        SanitizeError::Json(e)
    }
}

impl<'a> Request<'a> {
    /// A top-level member's raw text.
    pub fn member(&self, key: &str) -> Option<&'a RawValue> {
        self.members
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, raw)| *raw)
    }

    /// Checks every member (duplicate keys at any depth, URL sources unless allowed), applies
    /// the sanitizer's edits and writes the body to send. Errors leave nothing half-written
    /// behind: the body is built only once everything passed.
    pub fn sanitize(&self, opts: &Options<'_>) -> Result<Sanitized, SanitizeError> {
        let out = Vec::with_capacity(self.body.len() + opts.model.len() + 16);
        self.sanitize_into(opts, out)
    }

    /// [`Request::sanitize`], the body given as [`Pieces`] of the parsed body and of what was
    /// written anew.
    pub fn sanitize_to_pieces(
        &self,
        opts: &Options<'_>,
    ) -> Result<Sanitized<Pieces>, SanitizeError> {
        self.sanitize_into(opts, PieceSink::new(self.body))
            .map(Sanitized::into_pieces)
    }

    fn sanitize_into<S: Sink>(
        &self,
        opts: &Options<'_>,
        out: S,
    ) -> Result<Sanitized<S>, SanitizeError> {
        let mut ctx = Ctx::new(opts);
        let check_urls = !opts.allow_url_sources;
        let mut walked = Vec::with_capacity(self.members.len());
        for (key, raw) in &self.members {
            let mut de = serde_json::Deserializer::from_str(raw.get());
            let w = de
                .deserialize_any(Walk {
                    ctx: &mut ctx,
                    mode: Mode::member(key, check_urls),
                })
                .map_err(|e| keyed_error(e, ctx.duplicate))?;
            de.end()?;
            walked.push(w);
        }
        let members: Vec<(&str, &str)> = self
            .members
            .iter()
            .map(|(k, raw)| (k.as_ref(), raw.get()))
            .collect();
        finish(&members, &walked, &ctx, opts, out)
    }
}

/// [`parse`] and [`Request::sanitize`] in one scan of the body, with the same answer: every
/// member is walked while the top level is read, and its raw text is located from where the
/// body lends its keys. A body this cannot take that way (a top-level key with escapes, which
/// the body cannot lend) or any refusal goes through the two steps instead, so errors are
/// exactly theirs (which fault is reported first included).
pub fn sanitize(body: &[u8], opts: &Options<'_>) -> Result<Sanitized, SanitizeError> {
    let out = || Vec::with_capacity(body.len() + opts.model.len() + 16);
    match one_pass(body, opts, out()) {
        Some(done) => Ok(done),
        None => parse(body)?.sanitize_into(opts, out()),
    }
}

/// [`sanitize`], the body given as [`Pieces`] of `body` and of what was written anew.
pub fn sanitize_to_pieces(
    body: &[u8],
    opts: &Options<'_>,
) -> Result<Sanitized<Pieces>, SanitizeError> {
    match one_pass(body, opts, PieceSink::new(body)) {
        Some(done) => Ok(done.into_pieces()),
        None => parse(body)?.sanitize_to_pieces(opts),
    }
}

impl Sanitized<PieceSink> {
    fn into_pieces(self) -> Sanitized<Pieces> {
        Sanitized {
            body: self.body.pieces,
            report: self.report,
            max_tokens: self.max_tokens,
            input_tokens: self.input_tokens,
        }
    }
}

fn one_pass<S: Sink>(body: &[u8], opts: &Options<'_>, out: S) -> Option<Sanitized<S>> {
    let text = simdutf8::basic::from_utf8(body).ok()?;
    let mut ctx = Ctx::new(opts);
    let mut de = serde_json::Deserializer::from_str(text);
    let top = de
        .deserialize_any(OnePass {
            ctx: &mut ctx,
            check_urls: !opts.allow_url_sources,
        })
        .ok()?;
    de.end().ok()?;
    let members = member_texts(text, top.iter().map(|(k, _)| *k))?;
    let walked: Vec<Walked<'_>> = top.into_iter().map(|(_, w)| w).collect();
    finish(&members, &walked, &ctx, opts, out).ok()
}

/// JSON's whitespace.
const JSON_SPACE: [char; 4] = [' ', '\t', '\n', '\r'];

/// Each top-level member's raw text (what `&RawValue` would hold: the value without the
/// whitespace around it), found from where each key, borrowed from `text`, sits in it: after a
/// key come its closing quote, a colon and the value; the value ends before the comma that
/// precedes the next key (or before the closing brace). `text` must already have parsed as an
/// object with exactly these keys, in order; `None` if a key does not point into it.
fn member_texts<'a>(
    text: &'a str,
    keys: impl ExactSizeIterator<Item = &'a str>,
) -> Option<Vec<(&'a str, &'a str)>> {
    let base = text.as_ptr().addr();
    let n = keys.len();
    let starts: Vec<(&'a str, usize)> = keys
        .map(|k| {
            let at = k.as_ptr().addr().checked_sub(base)?;
            (text.get(at..at + k.len()) == Some(k) && text.get(at.checked_sub(1)?..at)? == "\"")
                .then_some((k, at))
        })
        .collect::<Option<_>>()?;
    let close = text.trim_end_matches(JSON_SPACE).strip_suffix('}')?.len();
    let mut out = Vec::with_capacity(n);
    for (i, &(key, at)) in starts.iter().enumerate() {
        let after = text
            .get(at + key.len()..)?
            .strip_prefix('"')?
            .trim_start_matches(JSON_SPACE)
            .strip_prefix(':')?
            .trim_start_matches(JSON_SPACE);
        let from = text.len() - after.len();
        let value = match starts.get(i + 1) {
            // The next key's opening quote, then back over the comma between.
            Some(&(_, next)) => text
                .get(from..next.checked_sub(1)?)?
                .trim_end_matches(JSON_SPACE)
                .strip_suffix(',')?
                .trim_end_matches(JSON_SPACE),
            None => text.get(from..close)?.trim_end_matches(JSON_SPACE),
        };
        if value.is_empty() {
            return None;
        }
        out.push((key, value));
    }
    Some(out)
}

/// The top level of [`one_pass`]: each member's key (borrowed from the body) and walk.
struct OnePass<'c, 'de> {
    ctx: &'c mut Ctx<'de>,
    check_urls: bool,
}

impl<'de> Visitor<'de> for OnePass<'_, 'de> {
    type Value = Vec<(&'de str, Walked<'de>)>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut members: Vec<(&'de str, Walked<'de>)> = Vec::with_capacity(16);
        let mut keys: Vec<Cow<'de, str>> = Vec::with_capacity(16);
        let mut seen = Seen::default();
        while let Some(key) = map.next_key_seed(KeySeed)? {
            let k: &'de str = match &key {
                Cow::Borrowed(k) => k,
                // Not lent by the body: [`parse`] takes it.
                Cow::Owned(_) => return Err(de::Error::custom("a top-level key with escapes")),
            };
            if seen.repeated(&key, keys.iter()) {
                return Err(duplicate(k));
            }
            let w = map.next_value_seed(Walk {
                ctx: &mut *self.ctx,
                mode: Mode::member(k, self.check_urls),
            })?;
            keys.push(key);
            members.push((k, w));
        }
        Ok(members)
    }
}

/// What [`Request::sanitize`] does once every member is walked: the refusals found in the walk,
/// the edits, the estimate and the body to send. `members` are the top-level keys and raw
/// texts, in order, `walked` their walks.
fn finish<S: Sink>(
    members: &[(&str, &str)],
    walked: &[Walked<'_>],
    ctx: &Ctx<'_>,
    opts: &Options<'_>,
    mut out: S,
) -> Result<Sanitized<S>, SanitizeError> {
    // The first URL source in body order, as the tree walk reports it.
    if let Some(path) = members
        .iter()
        .zip(walked)
        .find_map(|((key, _), w)| w.url.as_ref().map(|hit| hit.path(key)))
    {
        return Err(SanitizeError::UrlSource { path });
    }

    let mut report = Report::default();
    let mut tools_at = None;
    let mut choice_at = None;
    let mut max_tokens = MaxTokens::Missing;
    let mut has_model = false;
    for (i, ((key, _), w)) in members.iter().zip(walked).enumerate() {
        match *key {
            "model" => {
                has_model = true;
                if w.kind == Kind::String {
                    report.requested_model = w.text().map(str::to_owned);
                }
            }
            "tools" => {
                if w.kind != Kind::Array {
                    return Err(SanitizeError::ToolsNotArray {
                        found: w.kind.name(),
                    });
                }
                if let Some((index, tool)) = ctx
                    .tools
                    .iter()
                    .enumerate()
                    .find(|(_, t)| t.kind != Kind::Object)
                {
                    return Err(SanitizeError::ToolNotObject {
                        index,
                        found: tool.kind.name(),
                    });
                }
                tools_at = Some(i);
            }
            "tool_choice" => choice_at = Some(i),
            "max_tokens" => {
                max_tokens = match w.uint() {
                    Some(n) if n > 0 => MaxTokens::Value(n),
                    Some(_) | None => MaxTokens::Invalid,
                };
            }
            _ => {}
        }
    }

    // Server tools: a `type` other than "custom".
    let removed: Vec<usize> = ctx
        .tools
        .iter()
        .enumerate()
        .filter(|(_, t)| match &t.type_ {
            Field::Absent => false,
            Field::Str(s) => s != "custom",
            Field::Other => true,
        })
        .map(|(i, _)| i)
        .collect();
    let tool_raws: Option<Vec<&RawValue>> = match (tools_at, removed.is_empty()) {
        (Some(i), false) => Some(serde_json::from_str(members[i].1)?),
        (Some(_) | None, true) | (None, false) => None,
    };
    for &i in &removed {
        let tool = &ctx.tools[i];
        let tool_type = match &tool.type_ {
            Field::Str(s) => s.as_ref().to_owned(),
            // Compact JSON of a type that was not a string (rare: only for the log).
            Field::Other | Field::Absent => tool_raws
                .as_ref()
                .and_then(|raws| raws.get(i))
                .and_then(|raw| serde_json::from_str::<serde_json::Value>(raw.get()).ok())
                .and_then(|v| v.get("type").map(serde_json::Value::to_string))
                .unwrap_or_default(),
        };
        report.removed_tools.push(RemovedTool {
            name: tool.name.as_deref().map(str::to_owned),
            tool_type,
        });
    }
    let kept = |i: &usize| !removed.contains(i);
    let tools_key_removed = !ctx.tools.is_empty() && removed.len() == ctx.tools.len();
    let mut drop_choice = false;
    if tools_key_removed {
        report.tools_key_removed = true;
        drop_choice = choice_at.is_some();
    } else if let Some(c) = choice_at {
        let choice = &walked[c];
        if choice.kind == Kind::Object
            && matches!(choice.type_(), Field::Str(t) if t == "tool")
            && let Some(name) = choice.name()
        {
            let still_present = (0..ctx.tools.len())
                .filter(kept)
                .any(|i| ctx.tools[i].name.as_deref() == Some(name));
            drop_choice = !still_present
                && report
                    .removed_tools
                    .iter()
                    .any(|r| r.name.as_deref() == Some(name));
        }
    }
    report.tool_choice_removed = drop_choice;
    for field in REMOVED_FIELDS {
        if members.iter().any(|(k, _)| *k == field) {
            report.removed_fields.push(field);
        }
    }
    let capped = match (max_tokens, opts.max_tokens_cap) {
        (MaxTokens::Value(n), Some(cap)) if n > cap => {
            max_tokens = MaxTokens::Value(cap);
            Some(cap)
        }
        (MaxTokens::Value(_) | MaxTokens::Missing | MaxTokens::Invalid, _) => None,
    };

    // The estimate of what is sent: system, messages, the kept tools, a kept tool_choice.
    let mut tally = Tally::default();
    for ((key, _), w) in members.iter().zip(walked) {
        match *key {
            "system" | "messages" => tally.add(w.tally),
            "tool_choice" if !drop_choice => tally.bytes += w.len,
            _ => {}
        }
    }
    if tools_at.is_some() {
        for (i, tool) in ctx.tools.iter().enumerate() {
            if kept(&i) {
                tally.bytes += tool.len;
            }
        }
    }
    let input_tokens = match opts.estimate {
        Some(rules) => (tally.bytes.div_ceil(rules.bytes_per_token.max(1)) + tally.fixed).max(1),
        None => 0,
    };

    out.put(b"{");
    let mut first = true;
    for (i, ((key, raw), w)) in members.iter().zip(walked).enumerate() {
        let k = *key;
        if REMOVED_FIELDS.contains(&k)
            || (k == "tools" && tools_key_removed)
            || (k == "tool_choice" && drop_choice)
        {
            continue;
        }
        if !first {
            out.put(b",");
        }
        first = false;
        serde_json::to_writer(Put(&mut out), k)?;
        out.put(b":");
        match k {
            "model" => serde_json::to_writer(Put(&mut out), opts.model)?,
            "max_tokens" if let Some(cap) = capped => out.put(cap.to_string().as_bytes()),
            "tools" if tools_at == Some(i) && !removed.is_empty() => {
                out.put(b"[");
                let raws = tool_raws.as_deref().unwrap_or_default();
                let mut first_tool = true;
                for (t, raw) in raws.iter().enumerate() {
                    if kept(&t) {
                        if !first_tool {
                            out.put(b",");
                        }
                        first_tool = false;
                        out.copy(raw.get());
                    }
                }
                out.put(b"]");
            }
            "metadata" if opts.strip_metadata_user_id && w.kind == Kind::Object => {
                write_without(&mut out, raw, "user_id")?;
            }
            _ => out.copy(raw),
        }
    }
    if !has_model {
        if !first {
            out.put(b",");
        }
        out.put(b"\"model\":");
        serde_json::to_writer(Put(&mut out), opts.model)?;
    }
    out.put(b"}");
    Ok(Sanitized {
        body: out,
        report,
        max_tokens,
        input_tokens,
    })
}

/// Writes the object `raw` (already checked) without the member `key`, the others as raw text.
fn write_without<S: Sink>(out: &mut S, raw: &str, key: &str) -> Result<(), SanitizeError> {
    let Request { members, .. } = parse(raw.as_bytes())?;
    out.put(b"{");
    let mut first = true;
    for (k, v) in members.iter().filter(|(k, _)| k != key) {
        if !first {
            out.put(b",");
        }
        first = false;
        serde_json::to_writer(Put(&mut *out), k.as_ref())?;
        out.put(b":");
        out.copy(v.get());
    }
    out.put(b"}");
    Ok(())
}

/// The top level: an object's members, or what the body was instead.
enum Top<'de> {
    Object(Vec<(Cow<'de, str>, &'de RawValue)>),
    Other(&'static str),
}

struct TopVisitor<'d> {
    /// Set when the error returned is a duplicate key.
    dup: &'d mut bool,
}

impl<'de> Visitor<'de> for TopVisitor<'_> {
    type Value = Top<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Top<'de>, E> {
        Ok(Top::Other("boolean"))
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Top<'de>, E> {
        Ok(Top::Other("number"))
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Top<'de>, E> {
        Ok(Top::Other("number"))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Top<'de>, E> {
        Ok(Top::Other("number"))
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<Top<'de>, E> {
        Ok(Top::Other("string"))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Top<'de>, E> {
        Ok(Top::Other("null"))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Top<'de>, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Top::Other("array"))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Top<'de>, A::Error> {
        let mut members: Vec<(Cow<'de, str>, &'de RawValue)> = Vec::with_capacity(16);
        let mut seen = Seen::default();
        while let Some(key) = map.next_key_seed(KeySeed)? {
            if seen.repeated(&key, members.iter().map(|(k, _)| k)) {
                *self.dup = true;
                return Err(duplicate(&key));
            }
            let raw: &'de RawValue = map.next_value()?;
            members.push((key, raw));
        }
        Ok(Top::Object(members))
    }
}

fn duplicate<E: de::Error>(key: &str) -> E {
    E::custom(format_args!(
        "key {} appears twice in one object",
        crate::id::shown(key)
    ))
}

/// Past this many keys an object's duplicate check uses a hash set, not a scan.
const SCAN_KEYS: usize = 24;

/// The duplicate check of one object.
#[derive(Default)]
struct Seen<'de> {
    set: Option<HashSet<Cow<'de, str>>>,
}

impl<'de> Seen<'de> {
    /// Whether `key` is one of `before` (the object's keys so far, in a scan) or of the set.
    // A `Cow`, not a `&str`: the set takes a clone, which for a borrowed key copies nothing.
    #[allow(clippy::ptr_arg)]
    fn repeated<'k>(
        &mut self,
        key: &Cow<'de, str>,
        before: impl ExactSizeIterator<Item = &'k Cow<'de, str>> + Clone,
    ) -> bool
    where
        'de: 'k,
    {
        if let Some(set) = &mut self.set {
            return !set.insert(key.clone());
        }
        if before.clone().any(|k| k == key) {
            return true;
        }
        if before.len() >= SCAN_KEYS {
            let mut set: HashSet<Cow<'de, str>> = before.cloned().collect();
            set.insert(key.clone());
            self.set = Some(set);
        }
        false
    }
}

/// A key, borrowed from the body when it has no escapes.
struct KeySeed;

impl<'de> DeserializeSeed<'de> for KeySeed {
    type Value = Cow<'de, str>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Cow<'de, str>, D::Error> {
        d.deserialize_str(KeySeed)
    }
}

impl<'de> Visitor<'de> for KeySeed {
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
    fn visit_string<E: de::Error>(self, v: String) -> Result<Cow<'de, str>, E> {
        Ok(Cow::Owned(v))
    }
}

/// What the walk keeps across values: the open objects' keys, the top-level tools.
struct Ctx<'de> {
    /// The keys of the objects being walked, outermost first (each object scans its own).
    keys: Vec<Cow<'de, str>>,
    /// The elements of the top-level `tools`, in order.
    tools: Vec<ToolInfo<'de>>,
    rules: EstimateRules,
    /// The walk stopped at a duplicate key.
    duplicate: bool,
}

impl Ctx<'_> {
    fn new(opts: &Options<'_>) -> Self {
        Ctx {
            keys: Vec::new(),
            tools: Vec::new(),
            rules: opts.estimate.unwrap_or_default(),
            duplicate: false,
        }
    }
}

struct ToolInfo<'de> {
    kind: Kind,
    len: u64,
    type_: Field<'de>,
    name: Option<Cow<'de, str>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Null,
    Bool,
    Number,
    String,
    Array,
    Object,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Null => "null",
            Kind::Bool => "boolean",
            Kind::Number => "number",
            Kind::String => "string",
            Kind::Array => "array",
            Kind::Object => "object",
        }
    }
}

/// An object's `type` member.
#[derive(Debug, Default)]
enum Field<'de> {
    #[default]
    Absent,
    Str(Cow<'de, str>),
    /// Present, not a string.
    Other,
}

impl Field<'_> {
    fn as_str(&self) -> Option<&str> {
        match self {
            Field::Str(s) => Some(s),
            Field::Absent | Field::Other => None,
        }
    }
}

/// Text bytes and fixed tokens of the estimate.
#[derive(Debug, Clone, Copy, Default)]
struct Tally {
    bytes: u64,
    fixed: u64,
}

impl Tally {
    fn add(&mut self, other: Tally) {
        self.bytes += other.bytes;
        self.fixed += other.fixed;
    }
}

/// How the estimate reads a value (the tree-based estimate's functions, by name).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// Not counted on its own.
    Plain,
    /// `content(v)`: a string's text, a list of blocks, anything else as JSON.
    Content,
    /// `block(b)`: dispatched on the block's `type`.
    Block,
    /// One element of `messages`: its `content`.
    Message,
    /// The top-level `messages`.
    Messages,
    /// The top-level `tools`: each element recorded in [`Ctx::tools`].
    Tools,
}

#[derive(Debug, Clone, Copy)]
struct Mode {
    role: Role,
    /// Refuse URL sources in this value (`system`, `messages`).
    url: bool,
    /// Keep a string's text (`type`, `name`, `model`).
    keep_str: bool,
}

impl Mode {
    /// How a top-level member is walked.
    fn member(key: &str, check_urls: bool) -> Mode {
        let role = match key {
            "system" => Role::Content,
            "messages" => Role::Messages,
            "tools" => Role::Tools,
            _ => Role::Plain,
        };
        Mode {
            role,
            url: check_urls && matches!(role, Role::Content | Role::Messages),
            keep_str: key == "model",
        }
    }
}

/// Where a URL source was found, innermost step first.
#[derive(Debug)]
struct Hit {
    steps: Vec<Step>,
}

#[derive(Debug)]
enum Step {
    Key(String),
    Index(usize),
}

impl Hit {
    fn path(&self, top: &str) -> String {
        let mut path = top.to_owned();
        for step in self.steps.iter().rev() {
            match step {
                Step::Key(k) => {
                    path.push('.');
                    path.push_str(k);
                }
                Step::Index(i) => {
                    path.push('[');
                    path.push_str(&i.to_string());
                    path.push(']');
                }
            }
        }
        path
    }
}

/// What the walk learned about one value.
#[derive(Debug)]
struct Walked<'de> {
    kind: Kind,
    /// The length serde_json writes for it (compact).
    len: u64,
    /// Its estimate in its [`Role`].
    tally: Tally,
    /// What else its kind tells.
    facts: Facts<'de>,
    /// A URL source inside, in a [`Mode::url`] walk (rare, so boxed).
    url: Option<Box<Hit>>,
}

/// What the walk keeps of a value beyond its length and tally, by kind. One enum rather than
/// a field for each: every value's [`Walked`] is returned up through serde's calls, and at
/// 168 bytes each return was a `memcpy` call (a quarter of a walk's time); at 104 it is a few
/// moves.
#[derive(Debug, Default)]
enum Facts<'de> {
    /// Nothing more: null, a boolean, an array, a number that is not a non-negative integer.
    #[default]
    None,
    /// A non-negative integer.
    Uint(u64),
    /// A string's decoded length and, when [`Mode::keep_str`], its text.
    Str {
        len: u64,
        text: Option<Cow<'de, str>>,
    },
    /// An object's `type`, `name` (when a string) and `data` length (when a string).
    Object {
        type_: Field<'de>,
        name: Option<Cow<'de, str>>,
        data_len: Option<u64>,
    },
}

/// An absent `type`, for what is not an object.
const NO_TYPE: Field<'static> = Field::Absent;

impl<'de> Walked<'de> {
    fn new(kind: Kind, len: u64) -> Self {
        Walked {
            kind,
            len,
            tally: Tally::default(),
            facts: Facts::None,
            url: None,
        }
    }

    fn uint(&self) -> Option<u64> {
        match self.facts {
            Facts::Uint(n) => Some(n),
            Facts::None | Facts::Str { .. } | Facts::Object { .. } => None,
        }
    }

    /// A string's decoded length.
    fn str_len(&self) -> Option<u64> {
        match self.facts {
            Facts::Str { len, .. } => Some(len),
            Facts::None | Facts::Uint(_) | Facts::Object { .. } => None,
        }
    }

    /// A kept string's text.
    fn text(&self) -> Option<&str> {
        match &self.facts {
            Facts::Str { text, .. } => text.as_deref(),
            Facts::None | Facts::Uint(_) | Facts::Object { .. } => None,
        }
    }

    /// A kept string's text, taken out.
    fn take_text(&mut self) -> Option<Cow<'de, str>> {
        match &mut self.facts {
            Facts::Str { text, .. } => text.take(),
            Facts::None | Facts::Uint(_) | Facts::Object { .. } => None,
        }
    }

    /// An object's `type` ([`Field::Absent`] for anything else).
    fn type_(&self) -> &Field<'de> {
        match &self.facts {
            Facts::Object { type_, .. } => type_,
            Facts::None | Facts::Uint(_) | Facts::Str { .. } => &NO_TYPE,
        }
    }

    /// An object's `name`, when a string.
    fn name(&self) -> Option<&str> {
        match &self.facts {
            Facts::Object { name, .. } => name.as_deref(),
            Facts::None | Facts::Uint(_) | Facts::Str { .. } => None,
        }
    }

    /// An object's `data` length, when a string.
    fn data_len(&self) -> Option<u64> {
        match self.facts {
            Facts::Object { data_len, .. } => data_len,
            Facts::None | Facts::Uint(_) | Facts::Str { .. } => None,
        }
    }

    /// An object's `type` and `name`, taken out.
    fn take_type_and_name(&mut self) -> (Field<'de>, Option<Cow<'de, str>>) {
        match &mut self.facts {
            Facts::Object { type_, name, .. } => (std::mem::take(type_), name.take()),
            Facts::None | Facts::Uint(_) | Facts::Str { .. } => (Field::Absent, None),
        }
    }
}

/// One value's walk.
struct Walk<'c, 'de> {
    ctx: &'c mut Ctx<'de>,
    mode: Mode,
}

impl<'de> DeserializeSeed<'de> for Walk<'_, 'de> {
    type Value = Walked<'de>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Walked<'de>, D::Error> {
        d.deserialize_any(self)
    }
}

fn digits(n: u64) -> u64 {
    n.checked_ilog10().map_or(1, |d| u64::from(d) + 1)
}

/// The bytes serde_json adds escaping `s`: `"`, backslash and the controls. Eight bytes at a
/// time, since only strings that arrived with escapes come here, and those are long texts.
fn escape_extra(s: &str) -> u64 {
    const LO: u64 = 0x0101_0101_0101_0101;
    const HI: u64 = 0x8080_8080_8080_8080;
    let has_zero = |x: u64| x.wrapping_sub(LO) & !x & HI;
    let mut extra = 0;
    let bytes = s.as_bytes();
    let mut chunks = bytes.chunks_exact(8);
    for chunk in &mut chunks {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        let x = u64::from_le_bytes(word);
        // Any byte < 0x20, `"` (0x22) or `\` (0x5c)?
        let special = (x.wrapping_sub(LO * 0x20) & !x & HI)
            | has_zero(x ^ (LO * 0x22))
            | has_zero(x ^ (LO * 0x5c));
        if special != 0 {
            extra += chunk.iter().map(|&b| byte_extra(b)).sum::<u64>();
        }
    }
    extra
        + chunks
            .remainder()
            .iter()
            .map(|&b| byte_extra(b))
            .sum::<u64>()
}

fn byte_extra(b: u8) -> u64 {
    match b {
        b'"' | b'\\' | 0x08 | 0x09 | 0x0a | 0x0c | 0x0d => 1,
        0x00..=0x1f => 5,
        _ => 0,
    }
}

impl<'de> Walk<'_, 'de> {
    /// A scalar's contribution in its role: `content` counts a string's text (done by the
    /// caller) and skips null; `block` counts any non-object as its JSON.
    fn scalar(self, kind: Kind, len: u64) -> Walked<'de> {
        let mut w = Walked::new(kind, len);
        match self.mode.role {
            Role::Content if kind != Kind::Null => w.tally.bytes = len,
            Role::Block => w.tally.bytes = len,
            Role::Content | Role::Plain | Role::Message | Role::Messages | Role::Tools => {}
        }
        w
    }

    fn string(self, s: &str, borrowed: Option<&'de str>) -> Walked<'de> {
        // A string that arrived without escapes has nothing to escape.
        let extra = if borrowed.is_some() {
            0
        } else {
            escape_extra(s)
        };
        let len = s.len() as u64;
        let keep = self.mode.keep_str;
        let role = self.mode.role;
        let mut w = self.scalar(Kind::String, len + extra + 2);
        if role == Role::Content {
            w.tally.bytes = len;
        }
        w.facts = Facts::Str {
            len,
            text: keep.then(|| match borrowed {
                Some(b) => Cow::Borrowed(b),
                None => Cow::Owned(s.to_owned()),
            }),
        };
        w
    }
}

/// The members of a block the estimate reads, kept until its `type` is known (it may come last).
#[derive(Default)]
struct BlockParts {
    /// `content(..)` of `text`, `thinking`, `data`, `content`, `name`.
    text: Option<Tally>,
    thinking: Option<Tally>,
    data: Option<Tally>,
    content: Option<Tally>,
    name: Option<Tally>,
    /// The `source`'s type and data length, when it is an object.
    source: Option<(Option<String>, Option<u64>)>,
    input_len: Option<u64>,
}

impl<'de> Visitor<'de> for Walk<'_, 'de> {
    type Value = Walked<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Walked<'de>, E> {
        Ok(self.scalar(Kind::Bool, if v { 4 } else { 5 }))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Walked<'de>, E> {
        Ok(self.scalar(Kind::Null, 4))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Walked<'de>, E> {
        let mut w = self.scalar(Kind::Number, digits(v));
        w.facts = Facts::Uint(v);
        Ok(w)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Walked<'de>, E> {
        let sign = u64::from(v < 0);
        Ok(self.scalar(Kind::Number, sign + digits(v.unsigned_abs())))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Walked<'de>, E> {
        // serde_json's own float writer, so the length is the one it writes.
        let mut w = ByteCounter(0);
        serde_json::to_writer(&mut w, &v).map_err(E::custom)?;
        Ok(self.scalar(Kind::Number, w.0))
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Walked<'de>, E> {
        Ok(self.string(v, Some(v)))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Walked<'de>, E> {
        Ok(self.string(v, None))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Walked<'de>, A::Error> {
        let Walk { ctx, mode } = self;
        let child_role = match mode.role {
            Role::Content => Role::Block,
            Role::Messages => Role::Message,
            Role::Plain | Role::Block | Role::Message | Role::Tools => Role::Plain,
        };
        let child = Mode {
            role: child_role,
            url: mode.url,
            keep_str: false,
        };
        let mut len = 2u64;
        let mut tally = Tally::default();
        let mut url = None;
        let mut index = 0usize;
        while let Some(mut item) = seq.next_element_seed(Walk {
            ctx: &mut *ctx,
            mode: child,
        })? {
            if index > 0 {
                len += 1;
            }
            len += item.len;
            match mode.role {
                Role::Content => tally.add(item.tally),
                Role::Messages => {
                    tally.add(item.tally);
                    tally.fixed += ctx.rules.message_overhead;
                }
                Role::Tools => {
                    let (type_, name) = item.take_type_and_name();
                    ctx.tools.push(ToolInfo {
                        kind: item.kind,
                        len: item.len,
                        type_,
                        name,
                    });
                }
                Role::Plain | Role::Block | Role::Message => {}
            }
            if url.is_none()
                && let Some(mut hit) = item.url
            {
                hit.steps.push(Step::Index(index));
                url = Some(hit);
            }
            index += 1;
        }
        let mut w = Walked::new(Kind::Array, len);
        w.tally = match mode.role {
            Role::Content | Role::Messages => tally,
            Role::Block => Tally {
                bytes: len,
                fixed: 0,
            },
            Role::Plain | Role::Message | Role::Tools => Tally::default(),
        };
        w.url = url;
        Ok(w)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Walked<'de>, A::Error> {
        let Walk { ctx, mode } = self;
        let start = ctx.keys.len();
        let mut seen = Seen::default();
        let mut len = 2u64;
        let mut count = 0usize;
        let mut type_ = Field::Absent;
        let mut name = None;
        let mut data_len = None;
        let mut parts = BlockParts::default();
        let mut message_content = Tally::default();
        let mut url_source = false;
        // The first URL source among the members, and one inside `input` (skipped if this
        // turns out to be a tool call).
        let mut first_hit: Option<Box<Hit>> = None;
        let mut input_hit: Option<(Box<Hit>, bool)> = None;
        while let Some(key) = map.next_key_seed(KeySeed)? {
            let repeated = {
                let (_, mine) = ctx.keys.split_at(start);
                seen.repeated(&key, mine.iter())
            };
            if repeated {
                ctx.duplicate = true;
                return Err(duplicate(&key));
            }
            let k = key.as_ref();
            let role = match (mode.role, k) {
                (Role::Block, "text" | "thinking" | "data" | "content" | "name")
                | (Role::Message, "content") => Role::Content,
                (
                    Role::Plain
                    | Role::Content
                    | Role::Block
                    | Role::Message
                    | Role::Messages
                    | Role::Tools,
                    _,
                ) => Role::Plain,
            };
            let mut child = map.next_value_seed(Walk {
                ctx: &mut *ctx,
                mode: Mode {
                    role,
                    url: mode.url,
                    keep_str: matches!(k, "type" | "name"),
                },
            })?;
            if count > 0 {
                len += 1;
            }
            count += 1;
            len += 2 + key.len() as u64 + escape_extra(k) + 1 + child.len;
            match k {
                "type" => {
                    type_ = match child.take_text() {
                        Some(t) if child.kind == Kind::String => Field::Str(t),
                        Some(_) | None => Field::Other,
                    }
                }
                "name" if child.kind == Kind::String => name = child.take_text(),
                "data" if child.kind == Kind::String => data_len = child.str_len(),
                _ => {}
            }
            if mode.role == Role::Block {
                match k {
                    "text" => parts.text = Some(child.tally),
                    "thinking" => parts.thinking = Some(child.tally),
                    "data" => parts.data = Some(child.tally),
                    "content" => parts.content = Some(child.tally),
                    "name" => parts.name = Some(child.tally),
                    "source" if child.kind == Kind::Object => {
                        parts.source =
                            Some((child.type_().as_str().map(str::to_owned), child.data_len()));
                    }
                    "input" => parts.input_len = Some(child.len),
                    _ => {}
                }
            }
            if mode.role == Role::Message && k == "content" {
                message_content = child.tally;
            }
            if k == "source" && child.kind == Kind::Object && child.type_().as_str() == Some("url")
            {
                url_source = true;
            }
            if let Some(mut hit) = child.url {
                hit.steps.push(Step::Key(k.to_owned()));
                if k == "input" {
                    input_hit = Some((hit, first_hit.is_none()));
                } else if first_hit.is_none() {
                    first_hit = Some(hit);
                }
            }
            ctx.keys.push(key);
        }
        ctx.keys.truncate(start);

        let mut w = Walked::new(Kind::Object, len);
        let tool_call = matches!(type_.as_str(), Some("tool_use" | "server_tool_use"));
        if mode.url {
            w.url = if url_source {
                Some(Box::new(Hit {
                    steps: vec![Step::Key("source".to_owned())],
                }))
            } else {
                // `input` counts unless this is a tool call, and wins if it came first.
                match input_hit {
                    Some((hit, true)) if !tool_call => Some(hit),
                    Some(_) | None => first_hit,
                }
            };
        }
        w.tally = match mode.role {
            Role::Content => Tally {
                bytes: len,
                fixed: 0,
            },
            Role::Message => message_content,
            Role::Block => block_tally(&ctx.rules, type_.as_str(), &parts, len),
            Role::Plain | Role::Messages | Role::Tools => Tally::default(),
        };
        w.facts = Facts::Object {
            type_,
            name,
            data_len,
        };
        Ok(w)
    }
}

/// The tree-based estimate's `block(b)` for an object block of JSON length `len`.
fn block_tally(rules: &EstimateRules, ty: Option<&str>, parts: &BlockParts, len: u64) -> Tally {
    let mut t = Tally::default();
    let content = |p: Option<Tally>| p.unwrap_or_default();
    match ty {
        Some("text") => t = content(parts.text),
        Some("image") => t.fixed = rules.image_tokens,
        Some("document") => {
            let (source_type, data_len) = match &parts.source {
                Some((ty, data)) => (ty.as_deref(), *data),
                None => (None, None),
            };
            match (source_type, data_len) {
                (Some("url"), _) => t.fixed = rules.url_document_tokens,
                (Some("base64"), Some(n)) => {
                    t.fixed = rules
                        .document_min_tokens
                        .max((n * 3 / 4).div_ceil(rules.bytes_per_token.max(1)));
                }
                (Some("text"), Some(n)) => t.bytes = n,
                _ => {
                    t.fixed = rules.document_min_tokens;
                    t.bytes = len;
                }
            }
        }
        Some("tool_use" | "server_tool_use") => {
            t = content(parts.name);
            // A missing input counts as `null`.
            t.bytes += parts.input_len.unwrap_or(4);
        }
        Some("tool_result") => t = content(parts.content),
        Some("thinking") => t = content(parts.thinking),
        Some("redacted_thinking") => t = content(parts.data),
        Some(_) | None => t.bytes = len,
    }
    t
}

/// An `io::Write` that keeps only the number of bytes written into it: the length of what
/// serde_json would write, without a buffer (the estimates count JSON text this way).
#[derive(Debug, Default)]
pub struct ByteCounter(pub u64);

impl std::io::Write for ByteCounter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len() as u64;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sanitize::{refuse_url_sources, sanitize_bytes_with_report, sanitize_request};
    use proptest::prelude::*;
    use serde_json::{Value, json};

    fn opts(model: &str) -> Options<'_> {
        Options {
            model,
            allow_url_sources: true,
            max_tokens_cap: None,
            strip_metadata_user_id: false,
            estimate: None,
        }
    }

    /// The two steps' answer, checked to be the one-scan [`sanitize`]'s too.
    fn new_path(body: &[u8], o: &Options<'_>) -> Result<Sanitized, SanitizeError> {
        let two = parse(body).and_then(|r| r.sanitize(o));
        match (&two, sanitize_to_pieces(body, o)) {
            (Ok(want), Ok(got)) => {
                assert_eq!(got.body.to_vec(body), want.body);
                assert_eq!(got.body.len(), want.body.len());
                assert_eq!(got.report, want.report);
            }
            (Err(want), Err(got)) => assert_eq!(got.to_string(), want.to_string()),
            (want, got) => panic!("two steps: {want:?}, pieces: {got:?}"),
        }
        match (&two, sanitize(body, o)) {
            (Ok(want), Ok(got)) => {
                assert_eq!(got.body, want.body);
                assert_eq!(got.report, want.report);
                assert_eq!(got.max_tokens, want.max_tokens);
                assert_eq!(got.input_tokens, want.input_tokens);
            }
            (Err(want), Err(got)) => assert_eq!(got.to_string(), want.to_string()),
            (want, got) => panic!("two steps: {want:?}, one scan: {got:?}"),
        }
        two
    }

    /// Every value's [`Walked`] travels up through serde's returns: kept small enough to be
    /// moved inline rather than by a `memcpy` call (see [`Facts`]).
    #[test]
    fn a_walked_value_stays_small() {
        let size = std::mem::size_of::<Walked<'_>>();
        eprintln!("Walked: {size} bytes");
        assert!(size <= 112, "{size}");
    }

    #[test]
    fn one_scan_finds_the_members_raw_text() {
        let body = br#" { "model" : "a" ,"messages":[ {"role":"user", "content":"h\u0069"} ]
            , "n":-1.5e3,"t":true , "s" : "x\"y" , "o": { "k" : [ 1 , 2 ] } } "#;
        let got = one_pass(body, &opts("up"), Vec::new()).expect("taken in one scan");
        assert_eq!(
            String::from_utf8(got.body).unwrap(),
            r#"{"model":"up","messages":[ {"role":"user", "content":"h\u0069"} ],"n":-1.5e3,"t":true,"s":"x\"y","o":{ "k" : [ 1 , 2 ] }}"#
        );
        new_path(body, &opts("up")).unwrap();
        // Untouched members are spans of the client's body, whatever way the body is taken.
        let pieces = sanitize_to_pieces(body, &opts("up")).unwrap().body;
        let spans = pieces.spans.iter().filter(|s| matches!(s, Span::Body(_)));
        assert_eq!(spans.count(), 5, "{pieces:?}");
        let pieces = parse(body)
            .unwrap()
            .sanitize_to_pieces(&opts("up"))
            .unwrap()
            .body;
        assert_eq!(pieces, sanitize_to_pieces(body, &opts("up")).unwrap().body);
        // A top-level key with escapes is not lent by the body: the two steps take it.
        let escaped = br#"{"mo\u0064el":"a","x":1}"#;
        assert!(one_pass(escaped, &opts("up"), Vec::new()).is_none());
        assert_eq!(
            new_path(escaped, &opts("up")).unwrap().body,
            br#"{"model":"up","x":1}"#
        );
        // Refusals are the two steps' own, whichever fault comes first in the body.
        for bad in [
            &br#"{"messages":[{"a":1,"a":2}],"x":}"#[..],
            br#"{"messages":[{"a":1,"a":2}],"model":"a","model":"b"}"#,
            br#"{"system":[{"source":{"type":"url"}}],"tools":{}}"#,
            br#"{"n":1e999,"messages":[{"a":1,"a":2}]}"#,
        ] {
            assert!(
                one_pass(
                    bad,
                    &Options {
                        allow_url_sources: false,
                        ..opts("up")
                    },
                    Vec::new()
                )
                .is_none()
            );
            new_path(
                bad,
                &Options {
                    allow_url_sources: false,
                    ..opts("up")
                },
            )
            .unwrap_err();
        }
        new_path(br#"{"a\"b":1,"model":"m"}"#, &opts("up")).unwrap();
        new_path(b"{}", &opts("up")).unwrap();
        new_path(b" {\n}\n", &opts("up")).unwrap();
    }

    /// The tree-based sanitizer's bytes and report for `v`, and this one's, for a compact body.
    fn same(v: &Value) -> Sanitized {
        let bytes = serde_json::to_vec(v).unwrap();
        let (want, want_report) = sanitize_bytes_with_report(&bytes, "m").unwrap();
        let got = new_path(&bytes, &opts("m")).unwrap();
        assert_eq!(
            String::from_utf8_lossy(&got.body),
            String::from_utf8_lossy(&want)
        );
        assert_eq!(got.report, want_report);
        got
    }

    fn keys(body: &[u8]) -> Vec<String> {
        let v: Value = serde_json::from_slice(body).unwrap();
        v.as_object().unwrap().keys().cloned().collect()
    }

    #[test]
    fn the_reference_cases_give_the_same_bytes() {
        let got = same(
            &json!({"max_tokens": 5, "model": "claude-x", "zz_unknown": {"a": [1]}, "messages": []}),
        );
        assert_eq!(
            keys(&got.body),
            ["max_tokens", "model", "zz_unknown", "messages"]
        );
        assert_eq!(got.report.requested_model.as_deref(), Some("claude-x"));
        assert!(!got.report.removed_anything());
        assert_eq!(got.max_tokens, MaxTokens::Value(5));
        let got = same(&json!({"messages": []}));
        assert_eq!(keys(&got.body), ["messages", "model"]);
        assert_eq!(got.max_tokens, MaxTokens::Missing);
        same(&json!({}));
        let got = same(&json!({"model": 7, "max_tokens": 1.5}));
        assert_eq!(got.report.requested_model, None);
        assert_eq!(got.max_tokens, MaxTokens::Invalid);
        let got = same(&json!({
            "model": "a",
            "container": "c",
            "tools": [
                {"name": "Bash", "input_schema": {}},
                {"type": "web_search_20250305", "name": "web_search"},
                {"type": "custom", "name": "Mine", "input_schema": {}},
                {"type": null, "name": "weird"},
                {"type": {"x": [1, 2]}, "name": "odd"},
            ],
            "mcp_servers": [{"url": "https://x"}],
            "context_management": {},
            "tool_choice": {"type": "auto"},
            "stream": true,
        }));
        assert_eq!(keys(&got.body), ["model", "tools", "tool_choice", "stream"]);
        assert_eq!(got.report.removed_tools[1].tool_type, "null");
        assert_eq!(got.report.removed_tools[2].tool_type, r#"{"x":[1,2]}"#);
        let got = same(&json!({
            "model": "a",
            "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            "tool_choice": {"type": "any"},
            "messages": [],
        }));
        assert_eq!(keys(&got.body), ["model", "messages"]);
        assert!(got.report.tools_key_removed && got.report.tool_choice_removed);
        let got = same(&json!({"model": "a", "tools": [], "tool_choice": {"type": "auto"}}));
        assert!(!got.report.removed_anything());
        let got = same(&json!({
            "tools": [{"name": "Bash"}, {"type": "web_fetch_20250910", "name": "web_fetch"}],
            "tool_choice": {"type": "tool", "name": "web_fetch"},
        }));
        assert!(got.report.tool_choice_removed && !got.report.tools_key_removed);
        let got = same(&json!({
            "tools": [{"name": "Bash"}, {"type": "web_fetch_20250910", "name": "web_fetch"}],
            "tool_choice": {"type": "tool", "name": "Bash"},
        }));
        assert!(!got.report.tool_choice_removed);
        // Escapes in keys and strings, floats, negative numbers, unicode.
        same(&json!({"a\"b": "x\ny\u{1}\u{7f}é", "n": [-1, 0, 1.5e300, 2.0, -0.0], "model": "q"}));
    }

    #[test]
    fn refusals_match_the_reference() {
        for bad in [
            json!([1, {"a": 1}]),
            json!("x"),
            json!(null),
            json!(1),
            json!(true),
        ] {
            let bytes = serde_json::to_vec(&bad).unwrap();
            let old = sanitize_bytes_with_report(&bytes, "m").unwrap_err();
            let new = new_path(&bytes, &opts("m")).unwrap_err();
            assert!(matches!(new, SanitizeError::NotAnObject { .. }), "{new}");
            assert_eq!(new.to_string(), old.to_string());
        }
        for bad in [
            json!({"model": "a", "tools": {"name": "x"}}),
            json!({"model": "a", "tools": [{"name": "x"}, "web_search"]}),
            json!({"tools": null}),
        ] {
            let bytes = serde_json::to_vec(&bad).unwrap();
            let old = sanitize_bytes_with_report(&bytes, "m").unwrap_err();
            let new = new_path(&bytes, &opts("m")).unwrap_err();
            assert_eq!(new.to_string(), old.to_string());
        }
        for bad in [&b"{"[..], b"", b"{\"a\":1}x", b"{\"a\":\xff}", b"\xff"] {
            assert!(matches!(
                new_path(bad, &opts("m")),
                Err(SanitizeError::Json(_))
            ));
        }
    }

    /// The body's UTF-8 check (simdutf8's) refuses exactly what std refuses: overlong forms,
    /// encoded surrogates, code points past U+10FFFF, a sequence cut short, a stray
    /// continuation byte; and takes the longest valid forms.
    #[test]
    fn utf8_is_judged_as_std_judges_it() {
        let inside: [&[u8]; 10] = [
            b"\xc0\xaf",
            b"\xe0\x80\xaf",
            b"\xed\xa0\x80",
            b"\xf4\x90\x80\x80",
            b"\xe2\x82",
            b"\x80",
            b"\xf0\x9f\x98\x80",
            b"\xf4\x8f\xbf\xbf",
            b"\xef\xbf\xbf",
            "caf\u{e9} \u{2014} \u{1f600}".as_bytes(),
        ];
        for bytes in inside {
            let mut body = br#"{"model":"a","messages":[{"role":"user","content":""#.to_vec();
            body.extend_from_slice(bytes);
            body.extend_from_slice(br#""}]}"#);
            let valid = std::str::from_utf8(&body).is_ok();
            assert_eq!(parse(&body).is_ok(), valid, "{bytes:x?}");
            assert_eq!(new_path(&body, &opts("m")).is_ok(), valid, "{bytes:x?}");
        }
    }

    #[test]
    fn url_sources_are_refused_where_the_reference_refuses_them() {
        let url_image = json!({"type": "image", "source": {"type": "url", "url": "https://evil.example/?d=secret"}});
        let cases = [
            json!({"messages": [
                {"role": "user", "content": "hi"},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                    "content": [{"type": "text", "text": "ok"}, url_image.clone()]}]},
            ]}),
            json!({"system": [{"type": "document", "source": {"type": "url", "url": "https://x/a.pdf"}}]}),
            json!({"system": {"source": {"type": "url"}, "z": [url_image.clone()]}}),
            // Inside `input` of a tool call it is the model's data; elsewhere `input` is walked,
            // whether `type` comes before or after it.
            json!({"messages": [{"content": [{"input": {"source": {"type": "url"}}, "type": "tool_use"}]}]}),
            json!({"messages": [{"content": [{"input": {"source": {"type": "url"}}, "type": "text"}]}]}),
            json!({"messages": [{"content": [{"a": [url_image.clone()], "input": {"source": {"type": "url"}}}]}]}),
            json!({"messages": [{"content": [{"input": [url_image.clone()], "a": {"source": {"type": "url"}}}]}]}),
            json!({"messages": [{"content": [{"a": [url_image.clone()], "source": {"type": "url"}}]}]}),
            json!({"messages": [{"content": [{"type": "server_tool_use", "input": [url_image.clone()]}]}]}),
            json!({"tools": [{"name": "x", "input_schema": {"properties": {"source": {"type": "url"}}}}]}),
        ];
        for case in cases {
            let bytes = serde_json::to_vec(&case).unwrap();
            let want = refuse_url_sources(&case).map_err(|e| e.to_string());
            let strict = Options {
                allow_url_sources: false,
                ..opts("m")
            };
            let got = new_path(&bytes, &strict)
                .map(|_| ())
                .map_err(|e| e.to_string());
            assert_eq!(got, want, "{case}");
            // Allowed, the same body passes.
            new_path(&bytes, &opts("m")).unwrap();
        }
    }

    #[test]
    fn duplicate_keys_are_refused_at_any_depth() {
        let cases: [&[u8]; 6] = [
            // Upstream keeping the first `model` would run the client's choice.
            br#"{"model":"a","messages":[],"model":"b"}"#,
            // A parser keeping the first `type` sees a server tool we would have kept.
            br#"{"model":"a","tools":[{"name":"web_search","type":"web_search_20250305","type":"custom"}]}"#,
            // One keeping the first `source` of a nested image fetches the URL.
            br#"{"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":[{"type":"image","source":{"type":"url","url":"https://evil.example/"},"source":{"type":"base64","media_type":"image/png","data":"AAAA"}}]}]}]}"#,
            br#"{"messages":[{"role":"user","content":[{"type":"image","source":{"type":"url","type":"base64","url":"https://evil.example/"}}]}]}"#,
            // Escaped spellings of one key are the same key.
            br#"{"metadata":{"user_id":"a","user\u005fid":"b"}}"#,
            br#"{"tool_choice":{"type":"tool","name":"a","name":"b"}}"#,
        ];
        for body in cases {
            match new_path(body, &opts("m")) {
                Err(SanitizeError::DuplicateKey(_)) => {}
                other => panic!("{}: {other:?}", String::from_utf8_lossy(body)),
            }
        }
        // Many keys (past the scan) still refuse a repeat, and pass without one.
        let mut big: String = (0..100).map(|i| format!("\"k{i}\":{i},")).collect();
        big.insert(0, '{');
        let ok = format!("{}\"end\":0}}", big);
        new_path(format!("{{\"x\":{ok}}}").as_bytes(), &opts("m")).unwrap();
        let bad = format!("{}\"k7\":0}}", big);
        assert!(matches!(
            new_path(format!("{{\"x\":{bad}}}").as_bytes(), &opts("m")),
            Err(SanitizeError::DuplicateKey(_))
        ));
        assert!(matches!(
            new_path(bad.as_bytes(), &opts("m")),
            Err(SanitizeError::DuplicateKey(_))
        ));
        // The same key in sibling objects is no repeat.
        new_path(
            br#"{"a":{"k":1},"b":{"k":{"k":1}},"k":[{"k":1},{"k":2}]}"#,
            &opts("m"),
        )
        .unwrap();
    }

    #[test]
    fn untouched_members_are_copied_verbatim() {
        let body = br#"{ "model" : "a", "messages" : [ {"role":"user", "content":"h\u0069"} ],
            "container" : {}, "max_tokens": 100 , "metadata": { "user_id" : "u", "x": 1 } }"#;
        let got = new_path(body, &opts("up")).unwrap();
        assert_eq!(
            String::from_utf8(got.body).unwrap(),
            r#"{"model":"up","messages":[ {"role":"user", "content":"h\u0069"} ],"max_tokens":100,"metadata":{ "user_id" : "u", "x": 1 }}"#
        );
        let o = Options {
            max_tokens_cap: Some(64),
            strip_metadata_user_id: true,
            ..opts("up")
        };
        let got = new_path(body, &o).unwrap();
        assert_eq!(
            String::from_utf8(got.body).unwrap(),
            r#"{"model":"up","messages":[ {"role":"user", "content":"h\u0069"} ],"max_tokens":64,"metadata":{"x":1}}"#
        );
        assert_eq!(got.max_tokens, MaxTokens::Value(64));
        // Under the cap, or not a positive integer: left as sent.
        let got = new_path(br#"{"max_tokens":0}"#, &o).unwrap();
        assert_eq!(got.body, br#"{"max_tokens":0,"model":"up"}"#);
        assert_eq!(got.max_tokens, MaxTokens::Invalid);
        let got = new_path(br#"{"max_tokens":"900","metadata":[]}"#, &o).unwrap();
        assert_eq!(
            got.body,
            br#"{"max_tokens":"900","metadata":[],"model":"up"}"#
        );
        // A parsed-equal body to the reference's, whatever the whitespace.
        let v: Value = serde_json::from_slice(body).unwrap();
        let mut old = v.clone();
        sanitize_request(&mut old, "up", true).unwrap();
        let got = new_path(body, &opts("up")).unwrap();
        assert_eq!(serde_json::from_slice::<Value>(&got.body).unwrap(), old);
    }

    fn key() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("type".to_owned()),
            Just("source".to_owned()),
            Just("name".to_owned()),
            Just("content".to_owned()),
            Just("input".to_owned()),
            Just("text".to_owned()),
            Just("data".to_owned()),
            "[a-z]{1,4}",
        ]
    }

    fn json_leaf() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            Just(json!("url")),
            Just(json!("custom")),
            Just(json!("tool_use")),
            Just(json!("image")),
            Just(json!("document")),
            Just(json!("base64")),
            "\\PC{0,8}".prop_map(Value::String),
            "[\\x00-\\x20\"\\\\a]{0,12}".prop_map(Value::String),
        ]
    }

    fn json_value() -> impl Strategy<Value = Value> {
        json_leaf().prop_recursive(4, 48, 5, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
                proptest::collection::vec((key(), inner), 0..5)
                    .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    fn top_key() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("model".to_owned()),
            Just("tools".to_owned()),
            Just("tool_choice".to_owned()),
            Just("system".to_owned()),
            Just("messages".to_owned()),
            Just("container".to_owned()),
            Just("max_tokens".to_owned()),
            "[a-z]{1,6}",
        ]
    }

    proptest! {
        #[test]
        fn escape_extra_counts_what_serde_json_adds(s in "\\PC{0,40}|[\\x00-\\x21\"\\\\\\x7f-\\u{a0}a]{0,40}") {
            let written = serde_json::to_string(&s).unwrap().len() as u64;
            prop_assert_eq!(escape_extra(&s), written - s.len() as u64 - 2);
        }
    }

    proptest! {
        #[test]
        fn same_as_the_reference_on_any_compact_body(
            fields in proptest::collection::vec((top_key(), json_value()), 0..8),
            tools in proptest::option::of(proptest::collection::vec(
                (proptest::option::of(prop_oneof![Just(json!("custom")), Just(json!("web_search_1")), Just(json!(null))]),
                "[ab]", json_value()), 0..4)),
            allow in any::<bool>(),
        ) {
            let mut obj: serde_json::Map<String, Value> = fields.into_iter().collect();
            if let Some(tools) = tools {
                let list: Vec<Value> = tools.into_iter().map(|(ty, name, extra)| {
                    let mut t = json!({"name": name, "x": extra});
                    if let Some(ty) = ty {
                        t["type"] = ty;
                    }
                    t
                }).collect();
                obj.insert("tools".into(), Value::Array(list));
                obj.insert("tool_choice".into(), json!({"type": "tool", "name": "a"}));
            }
            let body = serde_json::to_vec(&Value::Object(obj.clone())).unwrap();
            let mut old = Value::Object(obj);
            let want = sanitize_request(&mut old, "m", allow)
                .map(|report| (serde_json::to_vec(&old).unwrap(), report))
                .map_err(|e| e.to_string());
            let o = Options { allow_url_sources: allow, ..opts("m") };
            let got = new_path(&body, &o).map(|s| (s.body, s.report)).map_err(|e| e.to_string());
            prop_assert_eq!(got, want);
        }
    }
}
