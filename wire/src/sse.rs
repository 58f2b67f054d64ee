//! Server-sent events: an incremental decoder that follows the WHATWG "interpreting an event
//! stream" rules, and an encoder whose output that decoder (or any conforming one) reads back
//! unchanged.
//!
//! The decoder takes bytes exactly as they come off the socket: chunk boundaries may fall
//! anywhere (inside a line, between `\r` and `\n`, inside a multi-byte character). Lines end
//! with `\r\n`, `\n` or `\r`; `:` lines are comments; `data:` lines accumulate, joined by `\n`;
//! `event:`, `id:` and `retry:` are honoured; unknown fields are ignored; a leading UTF-8 BOM is
//! dropped; a blank line dispatches the event, and an event without any `data:` line is not
//! dispatched. At end of stream an unterminated event is discarded, as the spec says
//! ([`Decoder::has_pending`] tells whether that happened).
//!
//! The decoder holds at most one line and one event in memory, bounded by
//! [`Decoder::with_max_event_bytes`], so a hostile or broken upstream cannot make it buffer
//! without limit.

use memchr::memchr2;

/// Default bound on one event (its partial line plus its accumulated fields): large enough for a
/// tool call whose whole argument JSON (a file being written) arrives in one chunk.
pub const DEFAULT_MAX_EVENT_BYTES: usize = 16 << 20;

/// Whether a chunk of an event stream ends at a frame boundary (a blank line), as far as the
/// chunk itself shows; an empty chunk says nothing, so callers keep their previous answer.
pub fn ends_frame(chunk: &[u8]) -> bool {
    chunk.ends_with(b"\n\n") || chunk.ends_with(b"\r\n\r\n") || chunk.ends_with(b"\r\r")
}

/// One dispatched event.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Event {
    /// The `event:` field, empty when the event had none (clients then treat it as
    /// `"message"`).
    pub event: String,
    /// The `data:` lines joined with `\n`.
    pub data: String,
    /// The `id:` field if this event's block set one. The stream-wide "last event ID" that the
    /// spec carries from event to event is [`Decoder::last_event_id`].
    pub id: Option<String>,
    /// The `retry:` field if this event's block set a valid one.
    pub retry: Option<u64>,
}

impl Event {
    /// An event with a name and data and no `id`/`retry`.
    pub fn new(event: impl Into<String>, data: impl Into<String>) -> Self {
        Self {
            event: event.into(),
            data: data.into(),
            id: None,
            retry: None,
        }
    }
}

/// A dispatched event borrowed from the decoder's buffers, for callers that only inspect events
/// (the usage meter) and should not pay an allocation per event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventRef<'a> {
    pub event: &'a str,
    pub data: &'a str,
    pub id: Option<&'a str>,
    pub retry: Option<u64>,
}

impl EventRef<'_> {
    /// An owned copy.
    pub fn to_event(&self) -> Event {
        Event {
            event: self.event.to_owned(),
            data: self.data.to_owned(),
            id: self.id.map(str::to_owned),
            retry: self.retry,
        }
    }
}

/// Why decoding stopped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    /// One event grew past the limit. The decoder is left in an unspecified state: stop reading
    /// this stream.
    #[error("an SSE event exceeded {limit} bytes")]
    EventTooLarge { limit: usize },
}

/// Incremental SSE decoder. Feed it every chunk in order; it calls back (or appends) once per
/// dispatched event.
#[derive(Debug)]
pub struct Decoder {
    line: Vec<u8>,
    /// The previous chunk ended in `\r`, so a `\n` opening the next one belongs to it.
    skip_lf: bool,
    first_line: bool,
    event: String,
    data: String,
    id: Option<String>,
    retry: Option<u64>,
    last_event_id: String,
    reconnect_ms: Option<u64>,
    max_event_bytes: usize,
}

impl Default for Decoder {
    fn default() -> Self {
        Self::new()
    }
}

impl Decoder {
    /// A decoder with the [`DEFAULT_MAX_EVENT_BYTES`] bound.
    pub fn new() -> Self {
        Self::with_max_event_bytes(DEFAULT_MAX_EVENT_BYTES)
    }

    /// A decoder that refuses any single event larger than `limit` bytes.
    pub fn with_max_event_bytes(limit: usize) -> Self {
        Self {
            line: Vec::new(),
            skip_lf: false,
            first_line: true,
            event: String::new(),
            data: String::new(),
            id: None,
            retry: None,
            last_event_id: String::new(),
            reconnect_ms: None,
            max_event_bytes: limit,
        }
    }

    /// Decodes `chunk`, appending every event it completes to `out`.
    pub fn feed(&mut self, chunk: &[u8], out: &mut Vec<Event>) -> Result<(), SseError> {
        self.feed_with(chunk, |e| out.push(e.to_event()))
    }

    /// Decodes `chunk`, calling `on_event` for every event it completes, with borrowed fields.
    pub fn feed_with(
        &mut self,
        mut chunk: &[u8],
        mut on_event: impl FnMut(EventRef<'_>),
    ) -> Result<(), SseError> {
        if self.skip_lf && !chunk.is_empty() {
            self.skip_lf = false;
            if chunk[0] == b'\n' {
                chunk = &chunk[1..];
            }
        }
        while let Some(end) = memchr2(b'\r', b'\n', chunk) {
            if self.line.is_empty() {
                // The same bound as a line buffered across chunks: whether a stream is refused
                // must not depend on how the network split it.
                self.check_size(end)?;
                self.process_line(&chunk[..end], &mut on_event);
            } else {
                let mut line = std::mem::take(&mut self.line);
                line.extend_from_slice(&chunk[..end]);
                self.check_size(line.len())?;
                self.process_line(&line, &mut on_event);
                line.clear();
                self.line = line;
            }
            self.check_size(0)?;
            let mut next = end + 1;
            if chunk[end] == b'\r' {
                match chunk.get(next) {
                    Some(b'\n') => next += 1,
                    Some(_) => {}
                    None => self.skip_lf = true,
                }
            }
            chunk = &chunk[next..];
        }
        self.line.extend_from_slice(chunk);
        self.check_size(self.line.len())
    }

    fn check_size(&self, line_len: usize) -> Result<(), SseError> {
        let held = line_len + self.data.len() + self.event.len();
        if held > self.max_event_bytes {
            return Err(SseError::EventTooLarge {
                limit: self.max_event_bytes,
            });
        }
        Ok(())
    }

    fn process_line(&mut self, mut line: &[u8], on_event: &mut impl FnMut(EventRef<'_>)) {
        if self.first_line {
            self.first_line = false;
            if let Some(rest) = line.strip_prefix(b"\xEF\xBB\xBF") {
                line = rest;
            }
        }
        if line.is_empty() {
            self.dispatch(on_event);
            return;
        }
        if line[0] == b':' {
            return;
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(colon) => {
                let value = &line[colon + 1..];
                (&line[..colon], value.strip_prefix(b" ").unwrap_or(value))
            }
            None => (line, &b""[..]),
        };
        match field {
            b"data" => {
                push_utf8(&mut self.data, value);
                self.data.push('\n');
            }
            b"event" => {
                self.event.clear();
                push_utf8(&mut self.event, value);
            }
            b"id" if !value.contains(&0) => {
                let mut id = String::new();
                push_utf8(&mut id, value);
                self.last_event_id.clone_from(&id);
                self.id = Some(id);
            }
            b"retry" if !value.is_empty() && value.iter().all(u8::is_ascii_digit) => {
                // Digits only, so this is valid UTF-8; an overflowing value is ignored.
                if let Some(ms) = std::str::from_utf8(value)
                    .ok()
                    .and_then(|s| s.parse::<u64>().ok())
                {
                    self.retry = Some(ms);
                    self.reconnect_ms = Some(ms);
                }
            }
            _ => {}
        }
    }

    fn dispatch(&mut self, on_event: &mut impl FnMut(EventRef<'_>)) {
        if !self.data.is_empty() {
            self.data.pop();
            on_event(EventRef {
                event: &self.event,
                data: &self.data,
                id: self.id.as_deref(),
                retry: self.retry,
            });
        }
        self.data.clear();
        self.event.clear();
        self.id = None;
        self.retry = None;
    }

    /// The stream's last event ID: the value of the most recent `id:` field, kept across
    /// events as the spec requires (what a client would send as `Last-Event-ID`).
    pub fn last_event_id(&self) -> &str {
        &self.last_event_id
    }

    /// The most recent valid `retry:` value, in milliseconds.
    pub fn reconnection_time(&self) -> Option<u64> {
        self.reconnect_ms
    }

    /// Whether an unterminated event or line is buffered: at end of stream that means the
    /// upstream was cut off mid-event (the spec discards such an event).
    pub fn has_pending(&self) -> bool {
        let only_bom = self.first_line && b"\xEF\xBB\xBF".starts_with(&self.line);
        !(self.line.is_empty() || only_bom)
            || !self.data.is_empty()
            || !self.event.is_empty()
            || self.id.is_some()
            || self.retry.is_some()
    }
}

fn push_utf8(out: &mut String, bytes: &[u8]) {
    match std::str::from_utf8(bytes) {
        Ok(s) => out.push_str(s),
        Err(_) => out.push_str(&String::from_utf8_lossy(bytes)),
    }
}

/// SSE encoder. Stateless: each event is written whole, so frames can be sent as single writes.
#[derive(Debug, Clone, Copy, Default)]
pub struct Encoder;

impl Encoder {
    pub fn new() -> Self {
        Encoder
    }

    /// Appends one event: `event:` (if non-empty), `id:`, `retry:`, one `data:` line per line of
    /// `data` (at least one), then the blank line. A field value cannot hold a line break, so
    /// line breaks in `event` and `id` are written as spaces; `\r\n` and `\r` in `data` come
    /// back from a decoder as `\n`.
    pub fn encode(&self, event: &Event, out: &mut Vec<u8>) {
        if !event.event.is_empty() {
            write_field(out, b"event", &event.event);
        }
        if let Some(id) = &event.id {
            write_field(out, b"id", id);
        }
        if let Some(retry) = event.retry {
            out.extend_from_slice(b"retry: ");
            out.extend_from_slice(retry.to_string().as_bytes());
            out.push(b'\n');
        }
        let mut rest = event.data.as_bytes();
        loop {
            out.extend_from_slice(b"data: ");
            match memchr2(b'\r', b'\n', rest) {
                Some(end) => {
                    out.extend_from_slice(&rest[..end]);
                    out.push(b'\n');
                    let skip = if rest[end] == b'\r' && rest.get(end + 1) == Some(&b'\n') {
                        2
                    } else {
                        1
                    };
                    rest = &rest[end + skip..];
                }
                None => {
                    out.extend_from_slice(rest);
                    out.push(b'\n');
                    break;
                }
            }
        }
        out.push(b'\n');
    }

    /// Appends a comment line (`: text`), which every client ignores: the keep-alive that stops
    /// idle-stream watchdogs from firing. Line breaks in `text` become spaces.
    pub fn comment(&self, text: &str, out: &mut Vec<u8>) {
        out.extend_from_slice(b": ");
        push_single_line(out, text);
        out.extend_from_slice(b"\n\n");
    }
}

fn write_field(out: &mut Vec<u8>, name: &[u8], value: &str) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    push_single_line(out, value);
    out.push(b'\n');
}

fn push_single_line(out: &mut Vec<u8>, value: &str) {
    out.extend(
        value
            .bytes()
            .map(|b| if b == b'\r' || b == b'\n' { b' ' } else { b }),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_all(chunks: &[&[u8]]) -> Vec<Event> {
        let mut d = Decoder::new();
        let mut out = Vec::new();
        for c in chunks {
            d.feed(c, &mut out).unwrap();
        }
        out
    }

    #[test]
    fn whatwg_example_streams() {
        // The spec's examples: multi-line data, comments, id persistence, field without colon.
        let s = b"data: YHOO\ndata: +2\ndata: 10\n\n: test stream\n\ndata: first event\nid: 1\n\ndata:second event\nid\n\ndata:  third event\n\ndata\n\ndata\ndata\n\ndata:\n";
        let evs = decode_all(&[s]);
        let data: Vec<&str> = evs.iter().map(|e| e.data.as_str()).collect();
        assert_eq!(
            data,
            [
                "YHOO\n+2\n10",
                "first event",
                "second event",
                " third event",
                "",
                "\n"
            ]
        );
        assert_eq!(evs[1].id.as_deref(), Some("1"));
        assert_eq!(evs[2].id.as_deref(), Some(""));
    }

    #[test]
    fn crlf_split_between_chunks_is_one_line_end() {
        let evs = decode_all(&[b"event: a\r", b"\ndata: x\r", b"\n\r", b"\n"]);
        assert_eq!(evs, vec![Event::new("a", "x")]);
        let cr_only = decode_all(&[b"data: x\r\rdata: y\r\r"]);
        assert_eq!(cr_only, vec![Event::new("", "x"), Event::new("", "y")]);
    }

    #[test]
    fn bom_is_dropped_and_multibyte_split_survives() {
        let bytes = "\u{FEFF}data: h\u{e9}llo \u{1F600}\n\n".as_bytes();
        for cut in 0..bytes.len() {
            let evs = decode_all(&[&bytes[..cut], &bytes[cut..]]);
            assert_eq!(
                evs,
                vec![Event::new("", "h\u{e9}llo \u{1F600}")],
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn retry_and_last_event_id_persist() {
        let mut d = Decoder::new();
        let mut out = Vec::new();
        d.feed(b"retry: 3000\nid: 7\n\ndata: x\n\nretry: 12a\n\n", &mut out)
            .unwrap();
        assert_eq!(out, vec![Event::new("", "x")]);
        assert_eq!(d.reconnection_time(), Some(3000));
        assert_eq!(d.last_event_id(), "7");
        assert!(!d.has_pending());
        d.feed(b"data: partial", &mut out).unwrap();
        assert!(d.has_pending());
    }

    #[test]
    fn oversized_event_is_refused() {
        let mut d = Decoder::with_max_event_bytes(16);
        let mut out = Vec::new();
        assert!(d.feed(b"data: 0123456789\n", &mut out).is_ok());
        assert_eq!(
            d.feed(b"data: 0123456789\n", &mut out),
            Err(SseError::EventTooLarge { limit: 16 })
        );
        let mut d = Decoder::with_max_event_bytes(16);
        assert!(d.feed(&[b'x'; 17], &mut out).is_err());
    }

    /// Found by the `sse_decode` fuzz target: a long line (here an ignored field) that arrived
    /// in one chunk escaped the bound, the same line split across chunks was refused.
    #[test]
    fn the_bound_does_not_depend_on_the_split() {
        let stream = format!("x{}: y\ndata: z\n\n", "C".repeat(40));
        let mut whole = Decoder::with_max_event_bytes(32);
        let whole = whole.feed(stream.as_bytes(), &mut Vec::new());
        let mut split = Decoder::with_max_event_bytes(32);
        let mut out = Vec::new();
        let split = stream
            .as_bytes()
            .chunks(7)
            .try_for_each(|c| split.feed(c, &mut out));
        assert_eq!(whole, Err(SseError::EventTooLarge { limit: 32 }));
        assert_eq!(whole, split);
    }

    #[test]
    fn encoder_output_decodes_back() {
        let e = Event {
            event: "content_block_delta".into(),
            data: "line1\nline2\r\nline3\rline4".into(),
            id: Some("42".into()),
            retry: Some(10),
        };
        let mut buf = Vec::new();
        Encoder.encode(&e, &mut buf);
        Encoder.comment("keep-alive", &mut buf);
        let evs = decode_all(&[&buf]);
        assert_eq!(evs.len(), 1);
        assert_eq!(evs[0].data, "line1\nline2\nline3\nline4");
        assert_eq!(evs[0].id.as_deref(), Some("42"));
        assert_eq!(evs[0].retry, Some(10));
    }
}
