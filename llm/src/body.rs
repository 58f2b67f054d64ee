//! The one streaming body transformer, [`LlmBody`], and [`Answer`], a successful upstream
//! answer on its way to the client.
//!
//! An [`LlmBody`] owns the upstream byte stream and yields the client's bytes as they arrive:
//! passed through, or decoded as SSE and translated by a [`StreamTranslator`] ([`ChatToAnthropic`],
//! [`ChatToResponses`]). Chunks the upstream has ready together go out as one frame (a
//! `Hold`), so the client's connection pays one write for a burst, not one per event; a
//! daemon answers with [`LlmBody::into_body`], which takes a burst read with the upstream's head
//! before answering, so the client's head leaves in that same write.
//! Optionally a [`UsageMeter`] reads the bytes sent to the client (as they are handed to its
//! connection, held ones included), and its report goes to a settle callback **exactly
//! once**: when the body ends (cleanly or broken), or, if the client goes away first, when the
//! body is dropped, with what was metered up to then. Dropping the body drops the upstream
//! stream, which closes the connection and cancels the generation. A whole (non-stream) answer
//! was generated before its head, so cancelling saves nothing: with
//! [`Answer::read_rest_with`], one whose client goes away first is read to its end in the
//! background and settles on the usage the upstream reported.
//!
//! A translated stream whose answer is complete (the translator wrote its last event) still
//! reads what the upstream sends after it (its `[DONE]` and the end of the body), for at most
//! [`DRAIN_WAIT`] and [`DRAIN_LIMIT`] bytes, before the client's body ends: an upstream body
//! read to its end lets its connection go back to the pool, one dropped early closes it, and the
//! next call would pay a new connection (measured: a TCP connect and five more syscalls a call).
//! The meter settles as soon as the last event goes out, not after the drain.
//!
//! A broken event stream is ended with the client protocol's error frame (never a silent
//! truncation); a broken non-stream body cannot be repaired, so the response is aborted with an
//! io error. What the client sees of a break is generic; the detail is logged.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use agentbox_wire::anthropic::{ErrorType, StreamEvent};
use agentbox_wire::responses::ResponseStreamEvent;
use agentbox_wire::sse;
use agentbox_wire::translate::{
    ChatStreamTranslator, ResponseOptions, ResponsesOptions, ResponsesStreamTranslator,
};
use agentbox_wire::usage::{BodyKind, MeterReport, UsageMeter};
use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use bytes::Bytes;
use futures_util::{Stream, StreamExt, TryStreamExt};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::Protocol;

/// Why an upstream body broke (a reqwest error, in practice).
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// The upstream's body, chunk by chunk.
pub type UpstreamStream = Pin<Box<dyn Stream<Item = Result<Bytes, BodyError>> + Send>>;

/// A reqwest response's body as an [`UpstreamStream`].
pub fn upstream_stream(resp: reqwest::Response) -> UpstreamStream {
    Box::pin(resp.bytes_stream().map_err(BodyError::from))
}

/// Receives the meter's report once, at the end of the body or when it is dropped.
pub type Settle = Box<dyn FnOnce(MeterReport) + Send>;

/// What a client is told when its stream breaks.
const BROKEN_STREAM: &str = "upstream failed mid-stream";

/// How long a complete translated answer waits for the rest of the upstream's body (see the
/// module doc). Real servers send `[DONE]` with or right after the last chunk; a slower one costs
/// its connection, never the client more than this.
pub const DRAIN_WAIT: Duration = Duration::from_millis(250);

/// How many bytes after the last translated event are read and dropped before giving up on the
/// upstream's connection.
pub const DRAIN_LIMIT: usize = 64 * 1024;

/// How long the rest of a whole answer whose client went away is read for (see
/// [`Answer::read_rest_with`]); the upstream has it generated already, so this is transfer time.
pub const REST_WAIT: Duration = Duration::from_secs(60);

/// Where the rest of a whole answer is read when its client goes away first.
struct RestReader {
    tracker: TaskTracker,
    shutdown: CancellationToken,
}

/// Turns the `data` of the upstream's SSE events into the client protocol's frames.
pub trait StreamTranslator: Send {
    /// Frames sent as soon as the upstream answered (so a slow prefill does not trip the
    /// client's idle watchdog).
    fn start(&mut self, out: &mut Vec<u8>);
    /// Frames for one upstream event.
    fn push(&mut self, data: &str, out: &mut Vec<u8>);
    /// Frames for the upstream's clean end.
    fn finish(&mut self, out: &mut Vec<u8>);
    /// The frame that ends a broken stream; nothing follows it.
    fn fail(&mut self, message: &str, out: &mut Vec<u8>);
    /// Whether the client's stream is complete (nothing more will be read upstream).
    fn is_done(&self) -> bool;
}

/// OpenAI chat chunks → Anthropic Messages events.
#[derive(Debug)]
pub struct ChatToAnthropic(ChatStreamTranslator);

impl ChatToAnthropic {
    /// A translator answering with `opts` (model reported, tool names mapped back, ...).
    pub fn new(opts: ResponseOptions) -> Self {
        ChatToAnthropic(ChatStreamTranslator::new(opts))
    }
}

/// Frames `events` (Anthropic or Responses events, each with its `write_sse`).
fn write_events<E>(
    events: &[E],
    out: &mut Vec<u8>,
    write: impl Fn(&E, &mut Vec<u8>) -> Result<(), serde_json::Error>,
) {
    for e in events {
        if let Err(err) = write(e, out) {
            tracing::error!(error = %err, "cannot serialize a stream event");
        }
    }
}

impl StreamTranslator for ChatToAnthropic {
    fn start(&mut self, out: &mut Vec<u8>) {
        write_events(&self.0.start(), out, StreamEvent::write_sse);
    }
    fn push(&mut self, data: &str, out: &mut Vec<u8>) {
        write_events(&self.0.push_data(data), out, StreamEvent::write_sse);
    }
    fn finish(&mut self, out: &mut Vec<u8>) {
        write_events(&self.0.finish(), out, StreamEvent::write_sse);
    }
    fn fail(&mut self, message: &str, out: &mut Vec<u8>) {
        write_events(
            &[StreamEvent::error(ErrorType::ApiError, message)],
            out,
            StreamEvent::write_sse,
        );
    }
    fn is_done(&self) -> bool {
        self.0.is_done()
    }
}

/// OpenAI chat chunks → OpenAI Responses events (what Codex reads).
#[derive(Debug)]
pub struct ChatToResponses(ResponsesStreamTranslator);

impl ChatToResponses {
    /// A translator answering with `opts` (model and response id reported, ...).
    pub fn new(opts: ResponsesOptions) -> Self {
        ChatToResponses(ResponsesStreamTranslator::new(opts))
    }
}

impl StreamTranslator for ChatToResponses {
    fn start(&mut self, out: &mut Vec<u8>) {
        write_events(&self.0.start(), out, ResponseStreamEvent::write_sse);
    }
    fn push(&mut self, data: &str, out: &mut Vec<u8>) {
        write_events(&self.0.push_data(data), out, ResponseStreamEvent::write_sse);
    }
    fn finish(&mut self, out: &mut Vec<u8>) {
        write_events(&self.0.finish(), out, ResponseStreamEvent::write_sse);
    }
    fn fail(&mut self, _message: &str, out: &mut Vec<u8>) {
        // Ending the translation early is the protocol's failure: `response.failed` unless the
        // answer was already whole (its finish reason arrived), in which case it completes with
        // what it has. Either way it is the last event.
        write_events(&self.0.finish(), out, ResponseStreamEvent::write_sse);
    }
    fn is_done(&self) -> bool {
        self.0.is_done()
    }
}

enum Mode {
    /// Bytes as they come; `sse` says whether a break can be ended with an error frame.
    Passthrough {
        sse: Option<Protocol>,
        /// Whether the bytes forwarded so far end at an SSE frame boundary.
        at_boundary: bool,
        /// Watches an Anthropic stream for its last event, so an upstream that closes
        /// cleanly before it still ends the client's stream with an error frame.
        end: EndScan,
    },
    /// SSE decoded and translated.
    Translate {
        decoder: sse::Decoder,
        translator: Box<dyn StreamTranslator>,
        started: bool,
    },
    /// A body already in memory (a translated non-streamed answer).
    Ready(Option<Bytes>),
}

/// Whether an unmetered Anthropic event stream has shown its last event (`message_stop`, or
/// an `error` event, after which the upstream may close). A metered stream asks its meter,
/// which decodes the events anyway. The markers are JSON strings with their quotes: inside a
/// string value (a model's text, tool arguments) quotes are escaped, so the model cannot
/// forge them. A marker split across chunks is found through the bytes kept from before.
#[derive(Default)]
struct EndScan {
    seen: bool,
    tail: Vec<u8>,
}

impl EndScan {
    const MARKERS: [&'static [u8]; 2] = [b"\"message_stop\"", b"\"error\""];
    const KEEP: usize = 13; // the longest marker's length minus one

    fn feed(&mut self, bytes: &[u8]) {
        if self.seen {
            return;
        }
        let found = |hay: &[u8]| {
            Self::MARKERS
                .iter()
                .any(|m| memchr::memmem::find(hay, m).is_some())
        };
        // The stream's last bytes before this chunk, then the chunk's first: a marker across
        // the boundary. The buffer is reused, so a chunk costs no allocation.
        self.tail
            .extend_from_slice(&bytes[..bytes.len().min(Self::KEEP)]);
        self.seen = found(&self.tail) || found(bytes);
        if bytes.len() >= Self::KEEP {
            self.tail.clear();
            self.tail
                .extend_from_slice(&bytes[bytes.len() - Self::KEEP..]);
        } else {
            // A short chunk joins what was kept (a marker may span several such chunks).
            let excess = self.tail.len().saturating_sub(Self::KEEP);
            self.tail.drain(..excess);
        }
    }
}

/// Whether an Anthropic stream showed its last event: from its meter when it has one.
fn ended(meter: Option<&UsageMeter>, end: &EndScan) -> bool {
    match meter {
        Some(m) => m.report().complete || m.report().error.is_some(),
        None => end.seen,
    }
}

/// One step of the transformer.
enum Step {
    /// Bytes for the client: metered, and, when `last`, the end of the body.
    Data { bytes: Bytes, last: bool },
    /// The error frame that ends a broken stream: the meter settles first (the frame is ours,
    /// not the model's), then it goes out, then the body ends.
    Failure(Bytes),
    /// A broken body that cannot be ended cleanly.
    Abort(std::io::Error),
    /// The end.
    End,
}

/// The response body: see the module doc.
pub struct LlmBody {
    upstream: Option<UpstreamStream>,
    mode: Mode,
    meter: Option<(UsageMeter, Settle)>,
    done: bool,
    /// Data steps computed but not yet handed out (a translated chunk and its end).
    queued: VecDeque<Step>,
    /// The client has its whole answer; the rest of the upstream's body is being read.
    drain: Option<Drain>,
    /// Bytes ready for the client while more may be on the way (see `Hold`).
    hold: Hold,
    /// Set by [`Answer::read_rest_with`].
    rest: Option<RestReader>,
    /// Set by [`Answer::hold_while_upstream`]: dropped when the upstream call is over (the
    /// body's end, its drop, or the end of the background read of its rest).
    guard: Option<CallGuard>,
}

/// What [`Answer::hold_while_upstream`] keeps.
type CallGuard = Box<dyn std::any::Any + Send + Sync>;

/// Client bytes held back while the upstream may have more already read: handed out as one
/// frame, so a burst of upstream chunks costs the client's connection one write, not one each.
///
/// Why a burst arrives as many polls: hyper's client hands a body over one chunk at a time
/// (each chunk of a chunked body, i.e. each frame a streaming server wrote), and its
/// connection task decodes the next only after this body took the last, a scheduler turn or
/// two later. Returning each chunk as it comes made hyper's server write each: an event stream
/// of 24 frames read in one `recvfrom` left as 10 `writev`s. So while the upstream has
/// nothing ready the body yields (wakes itself and returns `Pending`, letting the upstream's
/// connection task run): again after every turn that brought a chunk, and [`Hold::QUIET`]
/// times after turns that brought none. Then the hold goes out. Measured with
/// `llm/tests/hold.rs` on one event loop: the next chunk of a burst comes two turns after the
/// last was taken (with only the turn after each chunk, every chunk still went alone); the
/// second quiet turn is slack for a busier runtime. A quiet upstream (a model between tokens)
/// thus costs a few scheduler turns per chunk, never a wait for data.
#[derive(Default)]
struct Hold {
    chunks: Vec<Bytes>,
    len: usize,
    /// Whether the upstream gave a chunk since the last yield.
    moved: bool,
    /// Yields in a row that brought nothing.
    quiet: u8,
}

impl Hold {
    /// The most a hold keeps: a chunk that would pass it goes out on its own (after what was
    /// held), so a large passthrough chunk is never copied.
    const LIMIT: usize = 16 * 1024;

    /// How many turns in a row that bring nothing a hold waits out.
    const QUIET: u8 = 2;

    fn takes(&self, bytes: &Bytes) -> bool {
        self.len + bytes.len() <= Self::LIMIT
    }

    fn push(&mut self, bytes: Bytes) {
        self.len += bytes.len();
        self.chunks.push(bytes);
        self.moved = true;
    }

    /// The upstream has nothing ready: yield, or hand the hold over (see [`Hold`]).
    fn on_pending(&mut self, cx: &mut Context<'_>) -> Option<Bytes> {
        if self.chunks.is_empty() {
            return None;
        }
        if std::mem::take(&mut self.moved) {
            self.quiet = 0;
        } else if self.quiet < Self::QUIET {
            self.quiet += 1;
        } else {
            return self.take();
        }
        cx.waker().wake_by_ref();
        None
    }

    /// Everything held, as one frame.
    fn take(&mut self) -> Option<Bytes> {
        self.moved = false;
        self.quiet = 0;
        let len = std::mem::take(&mut self.len);
        match self.chunks.len() {
            0 => None,
            1 => self.chunks.pop(),
            _ => {
                let mut joined = Vec::with_capacity(len);
                for chunk in self.chunks.drain(..) {
                    joined.extend_from_slice(&chunk);
                }
                Some(Bytes::from(joined))
            }
        }
    }
}

/// Reading what an upstream sends after the answer it streamed is complete.
///
/// The rest is usually read already (a `[DONE]` written with the last chunk), only not yet
/// handed over by hyper's client (see [`Hold`]): so the drain first yields, like a hold, for
/// [`Hold::QUIET`] turns in a row that bring nothing, and only then arms its timer. A timer is
/// not free on one event loop: registering the earliest deadline wakes the runtime's driver
/// through its eventfd (a `write` and another `epoll_wait`), measured on every translated
/// answer before this wait.
#[derive(Default)]
struct Drain {
    read: usize,
    /// Yields in a row that brought nothing.
    quiet: u8,
    /// Set once the quiet turns are over, inside the runtime.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Drain {
    /// Ready (always `Step::End`) once the upstream ended, broke, sent more than
    /// [`DRAIN_LIMIT`] or kept the body open past [`DRAIN_WAIT`]. `moved` is the hold's: set
    /// when a chunk was read, so a held last frame waits for the end that follows.
    fn poll(
        &mut self,
        upstream: &mut Option<UpstreamStream>,
        moved: &mut bool,
        cx: &mut Context<'_>,
    ) -> Poll<Step> {
        loop {
            let Some(up) = upstream.as_mut() else {
                return Poll::Ready(Step::End);
            };
            match up.as_mut().poll_next(cx) {
                Poll::Ready(Some(Ok(bytes))) => {
                    *moved = true;
                    self.quiet = 0;
                    self.read = self.read.saturating_add(bytes.len());
                    if self.read > DRAIN_LIMIT {
                        return Poll::Ready(Step::End);
                    }
                }
                Poll::Ready(None | Some(Err(_))) => return Poll::Ready(Step::End),
                Poll::Pending if self.deadline.is_none() && self.quiet < Hold::QUIET => {
                    self.quiet += 1;
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                Poll::Pending => {
                    let deadline = self
                        .deadline
                        .get_or_insert_with(|| Box::pin(tokio::time::sleep(DRAIN_WAIT)));
                    return match deadline.as_mut().poll(cx) {
                        Poll::Ready(()) => Poll::Ready(Step::End),
                        Poll::Pending => Poll::Pending,
                    };
                }
            }
        }
    }
}

impl std::fmt::Debug for LlmBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlmBody")
            .field("metered", &self.meter.is_some())
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl LlmBody {
    /// The upstream's bytes as they come. `sse`: the body is an event stream in that protocol
    /// (a break ends it with the protocol's error frame); `None`: a break aborts the response.
    pub fn passthrough(upstream: UpstreamStream, sse: Option<Protocol>) -> Self {
        Self::with_mode(
            Some(upstream),
            Mode::Passthrough {
                sse,
                at_boundary: true,
                end: EndScan::default(),
            },
        )
    }

    /// The upstream's event stream decoded and translated.
    pub fn translated(upstream: UpstreamStream, translator: Box<dyn StreamTranslator>) -> Self {
        Self::with_mode(
            Some(upstream),
            Mode::Translate {
                decoder: sse::Decoder::new(),
                translator,
                started: false,
            },
        )
    }

    /// A body already complete.
    pub fn ready(bytes: Bytes) -> Self {
        Self::with_mode(None, Mode::Ready(Some(bytes)))
    }

    fn with_mode(upstream: Option<UpstreamStream>, mode: Mode) -> Self {
        LlmBody {
            upstream,
            mode,
            meter: None,
            done: false,
            queued: VecDeque::new(),
            drain: None,
            hold: Hold::default(),
            rest: None,
            guard: None,
        }
    }

    /// Meters what the client receives with `meter`; `settle` gets the report exactly once.
    pub fn metered(mut self, meter: UsageMeter, settle: Settle) -> Self {
        self.meter = Some((meter, settle));
        self
    }

    /// Finishes the meter and hands its report over, once.
    fn settle(&mut self) {
        if let Some((meter, settle)) = self.meter.take() {
            settle(meter.finish());
        }
    }

    fn next_step(&mut self, cx: &mut Context<'_>) -> Poll<Step> {
        if let Some(step) = self.queued.pop_front() {
            return Poll::Ready(step);
        }
        if let Some(drain) = &mut self.drain {
            return drain.poll(&mut self.upstream, &mut self.hold.moved, cx);
        }
        let upstream = &mut self.upstream;
        let meter = self.meter.as_ref().map(|(m, _)| m);
        let moved = &mut self.hold.moved;
        match &mut self.mode {
            Mode::Ready(bytes) => Poll::Ready(match bytes.take() {
                Some(bytes) => Step::Data { bytes, last: true },
                None => Step::End,
            }),
            Mode::Passthrough {
                sse,
                at_boundary,
                end,
            } => {
                let Some(up) = upstream.as_mut() else {
                    return Poll::Ready(Step::End);
                };
                match up.as_mut().poll_next(cx) {
                    Poll::Pending => Poll::Pending,
                    Poll::Ready(None) => Poll::Ready(match sse {
                        Some(Protocol::Anthropic) if !ended(meter, end) => {
                            tracing::warn!(
                                "upstream ended an Anthropic stream before message_stop"
                            );
                            Step::Failure(Bytes::from(
                                Protocol::Anthropic.failure_frame(!*at_boundary, BROKEN_STREAM),
                            ))
                        }
                        Some(Protocol::Anthropic | Protocol::OpenAi) | None => Step::End,
                    }),
                    Poll::Ready(Some(Ok(bytes))) => {
                        *moved = true;
                        if !bytes.is_empty() {
                            *at_boundary = sse::ends_frame(&bytes);
                            if matches!(sse, Some(Protocol::Anthropic)) && meter.is_none() {
                                end.feed(&bytes);
                            }
                        }
                        Poll::Ready(Step::Data { bytes, last: false })
                    }
                    Poll::Ready(Some(Err(e))) => {
                        tracing::warn!(error = %agentbox_http::error_chain(e.as_ref()), "upstream broke mid-response");
                        Poll::Ready(match sse {
                            Some(protocol) => Step::Failure(Bytes::from(
                                protocol.failure_frame(!*at_boundary, BROKEN_STREAM),
                            )),
                            None => Step::Abort(std::io::Error::other(BROKEN_STREAM)),
                        })
                    }
                }
            }
            Mode::Translate {
                decoder,
                translator,
                started,
            } => {
                let mut out = Vec::new();
                if !*started {
                    *started = true;
                    translator.start(&mut out);
                    if !out.is_empty() {
                        return Poll::Ready(Step::Data {
                            bytes: Bytes::from(out),
                            last: false,
                        });
                    }
                }
                loop {
                    if translator.is_done() {
                        return Poll::Ready(Step::End);
                    }
                    let Some(up) = upstream.as_mut() else {
                        return Poll::Ready(Step::End);
                    };
                    let last = match up.as_mut().poll_next(cx) {
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(Some(Ok(chunk))) => {
                            *moved = true;
                            let decoded = decoder.feed_with(&chunk, |ev| {
                                translator.push(ev.data, &mut out);
                            });
                            if let Err(e) = decoded {
                                tracing::warn!(error = %e, "upstream stream is not valid SSE");
                                return Poll::Ready(self.fail_translated(out));
                            }
                            false
                        }
                        Poll::Ready(Some(Err(e))) => {
                            tracing::warn!(error = %agentbox_http::error_chain(e.as_ref()), "upstream broke mid-stream");
                            return Poll::Ready(self.fail_translated(out));
                        }
                        Poll::Ready(None) => {
                            translator.finish(&mut out);
                            // Nothing is left to drain, and a finished stream is not polled again.
                            *upstream = None;
                            true
                        }
                    };
                    if !out.is_empty() || last {
                        let last = last || translator.is_done();
                        return Poll::Ready(if out.is_empty() {
                            Step::End
                        } else {
                            Step::Data {
                                bytes: Bytes::from(out),
                                last,
                            }
                        });
                    }
                }
            }
        }
    }

    /// Ends a translated stream: what was translated before the break goes out (metered), then
    /// the translator's error frame.
    fn fail_translated(&mut self, before: Vec<u8>) -> Step {
        let mut frame = Vec::new();
        if let Mode::Translate { translator, .. } = &mut self.mode {
            translator.fail(BROKEN_STREAM, &mut frame);
        }
        let failure = Step::Failure(Bytes::from(frame));
        if before.is_empty() {
            failure
        } else {
            self.queued.push_back(failure);
            Step::Data {
                bytes: Bytes::from(before),
                last: false,
            }
        }
    }
}

impl Stream for LlmBody {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        loop {
            let step = match this.next_step(cx) {
                Poll::Pending => {
                    return match this.hold.on_pending(cx) {
                        Some(bytes) => Poll::Ready(Some(Ok(bytes))),
                        None => Poll::Pending,
                    };
                }
                Poll::Ready(step) => step,
            };
            match step {
                Step::Data { bytes, last } if this.hold.takes(&bytes) => {
                    // Metered as it is held: what the client is sent, in order (a passthrough
                    // stream's end is judged by its meter, which must have seen these).
                    this.meter_feed(&bytes);
                    this.hold.push(bytes);
                    if last {
                        // The answer stays held while the upstream's rest is drained: its end
                        // is usually a turn or two away, and then the client's body ends in
                        // the same write as its last frame.
                        this.complete();
                    }
                }
                step @ (Step::Data { .. } | Step::Failure(_) | Step::Abort(_) | Step::End) => {
                    if let Some(held) = this.hold.take() {
                        // What was held goes out first; the step follows on the next poll.
                        this.queued.push_front(step);
                        return Poll::Ready(Some(Ok(held)));
                    }
                    if let Step::Data { bytes, .. } = &step {
                        this.meter_feed(bytes);
                    }
                    return this.apply(step);
                }
            }
        }
    }
}

impl LlmBody {
    /// Bytes on their way to the client: the meter reads them as they go.
    fn meter_feed(&mut self, bytes: &[u8]) {
        if let Some((meter, _)) = self.meter.as_mut() {
            meter.feed(bytes);
        }
    }

    /// What a step gives the client (its data already metered).
    fn apply(&mut self, step: Step) -> Poll<Option<Result<Bytes, std::io::Error>>> {
        match step {
            Step::Data { bytes, last } => {
                if last {
                    self.complete();
                }
                Poll::Ready(Some(Ok(bytes)))
            }
            Step::Failure(frame) => {
                self.finish();
                Poll::Ready(Some(Ok(frame)))
            }
            Step::Abort(e) => {
                self.finish();
                Poll::Ready(Some(Err(e)))
            }
            Step::End => {
                self.finish();
                Poll::Ready(None)
            }
        }
    }
}

impl LlmBody {
    /// The response body, its first frame taken already when the upstream sent it (see
    /// `first_frame`): what a daemon answers with, so a burst leaves with the head.
    pub async fn into_body(mut self) -> Body {
        let first = self.first_frame().await;
        Body::from_stream(futures_util::stream::iter(first).chain(self))
    }

    /// The body's first frame when it is ready now or held (a hold waits out its own few
    /// turns, see [`Hold`]); `None` when there is nothing yet (a model still reading its
    /// prompt), and the head goes out at once, as before.
    ///
    /// Why: hyper's server writes a response's head as soon as the body it polls is not
    /// ready, so a head answered while the body held the upstream's burst went out in a write
    /// of its own, the burst in the next (measured: a `writev` of 142 bytes on every streamed
    /// answer). hyper's client hands a body's first chunk over with the head, so a burst read
    /// with the head is held at the first poll, and head, frames and (when the upstream's end
    /// was read too) the body's end leave in one write.
    async fn first_frame(&mut self) -> Option<Result<Bytes, std::io::Error>> {
        std::future::poll_fn(|cx| match Pin::new(&mut *self).poll_next(cx) {
            Poll::Ready(item) => Poll::Ready(item),
            Poll::Pending if !self.hold.chunks.is_empty() => Poll::Pending,
            Poll::Pending => Poll::Ready(None),
        })
        .await
    }

    /// The client has the whole answer (its last bytes metered): bill it now; the upstream's
    /// leftovers are read (or given up on) before the body ends.
    fn complete(&mut self) {
        self.settle();
        if self.upstream.is_some() {
            self.drain = Some(Drain::default());
        } else {
            self.queued.push_back(Step::End);
        }
    }

    /// The body is over: settle, and let go of the upstream connection now rather than when
    /// the client's side is torn down.
    fn finish(&mut self) {
        self.done = true;
        self.queued.clear();
        self.hold = Hold::default();
        self.settle();
        self.upstream = None;
        self.guard = None;
    }
}

impl Drop for LlmBody {
    fn drop(&mut self) {
        // A whole answer's client went away before its end: read the rest for its usage (on
        // the runtime the body lived on; without one there is nothing to read it with).
        if let Some(rest) = self.rest.take()
            && !self.done
            && matches!(self.mode, Mode::Passthrough { sse: None, .. })
            && self.meter.is_some()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
            && let Some(upstream) = self.upstream.take()
            && let Some((mut meter, settle)) = self.meter.take()
        {
            // Taken from the upstream but not yet sent (so not yet metered), in order.
            for step in self.queued.drain(..) {
                if let Step::Data { bytes, .. } = step {
                    meter.feed(&bytes);
                }
            }
            let guard = self.guard.take();
            rest.tracker.spawn_on(
                async move {
                    read_rest(upstream, meter, settle, rest.shutdown).await;
                    drop(guard);
                },
                &runtime,
            );
            return;
        }
        // The client went away (or the server is shutting down) before the end: the upstream
        // stream is dropped with us, which cancels the generation; bill what the meter saw.
        self.settle();
    }
}

/// Reads the rest of a whole answer into its meter (until its end, the meter's bound,
/// [`REST_WAIT`] or shutdown), then settles.
async fn read_rest(
    mut upstream: UpstreamStream,
    mut meter: UsageMeter,
    settle: Settle,
    shutdown: CancellationToken,
) {
    {
        let read = async {
            while !meter.is_stopped() {
                match upstream.next().await {
                    Some(Ok(chunk)) => meter.feed(&chunk),
                    Some(Err(_)) | None => break,
                }
            }
        };
        tokio::select! {
            () = read => {}
            () = tokio::time::sleep(REST_WAIT) => {
                tracing::warn!("the rest of an abandoned answer did not come in time; billing it as cut");
            }
            () = shutdown.cancelled() => {}
        }
    }
    drop(upstream);
    settle(meter.finish());
}

/// A successful upstream answer, ready to become the client's response.
#[derive(Debug)]
pub struct Answer {
    /// The status for the client.
    pub status: StatusCode,
    /// The body's content type for the client.
    pub content_type: HeaderValue,
    /// The body.
    pub body: LlmBody,
}

impl Answer {
    /// Whether the client's body is an event stream.
    pub fn body_kind(&self) -> BodyKind {
        BodyKind::from_content_type(self.content_type.to_str().unwrap_or(""))
    }

    /// Meters the client's body (an Anthropic answer, streamed or not); `settle` gets the
    /// report exactly once.
    pub fn metered(mut self, settle: impl FnOnce(MeterReport) + Send + 'static) -> Self {
        let meter = UsageMeter::new(self.body_kind());
        self.body = self.body.metered(meter, Box::new(settle));
        self
    }

    /// A whole (non-stream) answer whose client goes away before its end is read to its end
    /// in a task of `tracker` (for at most [`REST_WAIT`], never past `shutdown`), so its meter
    /// settles on the usage the upstream reported rather than on the part the client took: the
    /// upstream generated, and bills, all of it. A stream is cancelled as before (the rest of
    /// it is not generated yet). Call it after metering.
    #[must_use]
    pub fn read_rest_with(mut self, tracker: TaskTracker, shutdown: CancellationToken) -> Self {
        self.body.rest = Some(RestReader { tracker, shutdown });
        self
    }

    /// Keeps `guard` until the upstream call is over: the body's end, its drop, or (with
    /// [`Answer::read_rest_with`]) the end of the background read of its rest. A caller that
    /// bounds the calls in flight per client holds its permit here, so an answer its client
    /// left still counts while it is read.
    pub fn hold_while_upstream(mut self, guard: impl Send + Sync + 'static) -> Self {
        self.body.guard = Some(Box::new(guard));
        self
    }

    /// Meters the client's body as an OpenAI chat completion (streamed or not); `settle` gets
    /// the report exactly once.
    pub fn metered_chat(mut self, settle: impl FnOnce(MeterReport) + Send + 'static) -> Self {
        let meter = UsageMeter::chat(self.body_kind());
        self.body = self.body.metered(meter, Box::new(settle));
        self
    }

    /// The response, its body's first frame ready when the upstream sent it already (see
    /// [`LlmBody::into_body`]).
    pub async fn into_response(self) -> Response {
        let stream = self.body_kind() == BodyKind::EventStream;
        let mut resp = Response::new(self.body.into_body().await);
        *resp.status_mut() = self.status;
        let headers = resp.headers_mut();
        headers.insert(header::CONTENT_TYPE, self.content_type);
        if stream {
            headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::sync::{Arc, Mutex};

    use agentbox_wire::translate::ResponseOptions;
    use futures_util::StreamExt;

    use super::*;

    const START: &str = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"x\",\"content\":[],\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":10,\"output_tokens\":1}}}\n\n";
    const DELTA: &str = "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"hello\"}}\n\n";
    const END: &str = "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":5}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";

    type Reports = Arc<Mutex<Vec<MeterReport>>>;

    fn upstream(items: Vec<Result<&'static str, &'static str>>) -> UpstreamStream {
        Box::pin(futures_util::stream::iter(items.into_iter().map(|i| {
            i.map(|s| Bytes::from_static(s.as_bytes()))
                .map_err(|e| BodyError::from(std::io::Error::other(e)))
        })))
    }

    fn metered(body: LlmBody, kind: BodyKind) -> (LlmBody, Reports) {
        let reports: Reports = Arc::default();
        let sink = reports.clone();
        let body = body.metered(
            UsageMeter::new(kind),
            Box::new(move |r| sink.lock().unwrap().push(r)),
        );
        (body, reports)
    }

    async fn collect(body: &mut LlmBody) -> (String, Option<std::io::Error>) {
        let mut out = String::new();
        while let Some(item) = body.next().await {
            match item {
                Ok(b) => out.push_str(std::str::from_utf8(&b).unwrap()),
                Err(e) => return (out, Some(e)),
            }
        }
        (out, None)
    }

    /// An upstream handing its chunks over the way hyper's client body does: each one is
    /// ready only a scheduler turn after the last was taken.
    fn handed_over(chunks: Vec<&'static str>) -> UpstreamStream {
        let mut items = chunks.into_iter();
        let mut turn = false;
        Box::pin(futures_util::stream::poll_fn(move |cx| {
            turn = !turn;
            if turn {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            Poll::Ready(items.next().map(|s| Ok(Bytes::from_static(s.as_bytes()))))
        }))
    }

    async fn frames(body: &mut LlmBody) -> Vec<Bytes> {
        let mut out = Vec::new();
        while let Some(item) = body.next().await {
            out.push(item.unwrap());
        }
        out
    }

    /// A burst of chunks the upstream already has goes to the client as one frame (one write),
    /// passed through or translated; without the hold each chunk was a frame of its own.
    #[tokio::test]
    async fn a_burst_of_upstream_chunks_goes_out_as_one_frame() {
        let mut body = LlmBody::passthrough(
            handed_over(vec![START, DELTA, DELTA, END]),
            Some(Protocol::Anthropic),
        );
        let got = frames(&mut body).await;
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0], format!("{START}{DELTA}{DELTA}{END}").as_bytes());

        let chunks = vec![
            "data: {\"id\":\"c\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
            "data: {\"id\":\"c\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n",
            "data: {\"id\":\"c\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\n\n",
            "data: [DONE]\n\n",
        ];
        let translator = ChatToAnthropic::new(ResponseOptions::default());
        let mut body = LlmBody::translated(handed_over(chunks), Box::new(translator));
        let got = frames(&mut body).await;
        assert_eq!(got.len(), 1, "{got:?}");
        let text = std::str::from_utf8(&got[0]).unwrap();
        assert!(text.starts_with("event: message_start"), "{text}");
        assert!(
            text.ends_with("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"),
            "{text}"
        );
    }

    /// What is held goes out when the upstream has nothing more, without waiting for it; a
    /// chunk larger than a hold goes out on its own, not copied.
    #[tokio::test]
    async fn a_hold_never_waits_for_data_nor_copies_a_large_chunk() {
        let up: UpstreamStream =
            Box::pin(handed_over(vec![START, DELTA]).chain(futures_util::stream::pending()));
        let mut body = LlmBody::passthrough(up, Some(Protocol::Anthropic));
        let first = tokio::time::timeout(Duration::from_secs(5), body.next())
            .await
            .expect("held bytes go out while the upstream is quiet");
        assert_eq!(
            first.unwrap().unwrap(),
            format!("{START}{DELTA}").as_bytes()
        );

        static LARGE: [u8; Hold::LIMIT + 1] = [b' '; Hold::LIMIT + 1];
        let up: UpstreamStream = Box::pin(futures_util::stream::iter([
            Ok(Bytes::from_static(b"a")),
            Ok(Bytes::from_static(&LARGE)),
            Ok(Bytes::from_static(b"b")),
        ]));
        let got = frames(&mut LlmBody::passthrough(up, None)).await;
        assert_eq!(got.len(), 3, "{got:?}");
        assert_eq!(got[0], &b"a"[..]);
        assert_eq!(got[1].as_ptr(), LARGE.as_ptr(), "the large chunk itself");
        assert_eq!(got[2], &b"b"[..]);
    }

    /// A whole answer whose client took its first part and left: with `read_rest_with` the
    /// rest is read in the background and the usage the upstream reported is billed; without
    /// it, the meter has half a JSON document.
    #[tokio::test]
    async fn a_whole_answer_left_early_is_read_to_its_end_for_its_usage() {
        const A: &str = r#"{"type":"message","content":[{"type":"text","text":"a long"#;
        const B: &str = r#" answer"}],"usage":{"input_tokens":5,"output_tokens":70}}"#;
        for rest in [false, true] {
            let later = futures_util::stream::once(async {
                tokio::time::sleep(Duration::from_millis(50)).await;
                Ok::<_, BodyError>(Bytes::from_static(B.as_bytes()))
            });
            let up: UpstreamStream = Box::pin(upstream(vec![Ok(A)]).chain(later));
            let (body, reports) = metered(LlmBody::passthrough(up, None), BodyKind::Json);
            let mut answer = Answer {
                status: StatusCode::OK,
                content_type: HeaderValue::from_static("application/json"),
                body,
            };
            let tracker = TaskTracker::new();
            if rest {
                answer = answer.read_rest_with(tracker.clone(), CancellationToken::new());
            }
            // The caller's place among its calls in flight lasts as long as the upstream call.
            let guard = Arc::new(());
            answer = answer.hold_while_upstream(guard.clone());
            let mut body = answer.body;
            assert_eq!(body.next().await.unwrap().unwrap(), A.as_bytes());
            drop(body);
            assert_eq!(Arc::strong_count(&guard), if rest { 2 } else { 1 });
            tracker.close();
            tracker.wait().await;
            assert_eq!(Arc::strong_count(&guard), 1, "the guard outlived the call");
            let r = reports.lock().unwrap();
            assert_eq!(r.len(), 1, "settled once");
            assert!(r[0].whole_body);
            if rest {
                assert!(r[0].complete, "{:?}", r[0]);
                assert_eq!((r[0].usage.input_tokens, r[0].usage.output_tokens), (5, 70));
            } else {
                assert!(!r[0].complete && r[0].malformed == 1, "{:?}", r[0]);
            }
        }
    }

    /// Dropped where no runtime runs, a whole answer settles on what it read, no panic.
    #[test]
    fn a_whole_answer_dropped_outside_a_runtime_settles_at_once() {
        let up = upstream(vec![Ok(r#"{"type":"message","#)]);
        let (body, reports) = metered(LlmBody::passthrough(up, None), BodyKind::Json);
        let answer = Answer {
            status: StatusCode::OK,
            content_type: HeaderValue::from_static("application/json"),
            body,
        }
        .read_rest_with(TaskTracker::new(), CancellationToken::new());
        drop(answer);
        let r = reports.lock().unwrap();
        assert_eq!(r.len(), 1);
        assert!(r[0].whole_body && !r[0].complete, "{:?}", r[0]);
    }

    #[tokio::test]
    async fn settles_once_at_the_end() {
        let up = upstream(vec![Ok(START), Ok(DELTA), Ok(END)]);
        let (mut body, reports) = metered(
            LlmBody::passthrough(up, Some(Protocol::Anthropic)),
            BodyKind::EventStream,
        );
        let (out, err) = collect(&mut body).await;
        assert!(err.is_none());
        assert_eq!(
            out,
            format!("{START}{DELTA}{END}"),
            "passed through unchanged"
        );
        assert!(body.next().await.is_none(), "stays ended");
        drop(body);
        let reports = reports.lock().unwrap();
        assert_eq!(reports.len(), 1, "settled exactly once");
        assert!(reports[0].complete);
        assert_eq!(reports[0].usage.input_tokens, 10);
        assert_eq!(reports[0].usage.output_tokens, 5);
    }

    #[tokio::test]
    async fn settles_once_on_drop_with_what_was_metered() {
        let up: UpstreamStream =
            Box::pin(upstream(vec![Ok(START), Ok(DELTA)]).chain(futures_util::stream::pending()));
        let (mut body, reports) = metered(
            LlmBody::passthrough(up, Some(Protocol::Anthropic)),
            BodyKind::EventStream,
        );
        // Both chunks, however many frames they come in (a hold may join them).
        let mut got = Vec::new();
        while got.len() < START.len() + DELTA.len() {
            got.extend_from_slice(&body.next().await.unwrap().unwrap());
        }
        assert_eq!(got, format!("{START}{DELTA}").as_bytes());
        assert!(
            reports.lock().unwrap().is_empty(),
            "nothing settled mid-stream"
        );
        drop(body);
        let reports = reports.lock().unwrap();
        assert_eq!(reports.len(), 1);
        assert!(!reports[0].complete);
        assert_eq!(reports[0].usage.input_tokens, 10);
        assert!(reports[0].billable_usage().output_tokens >= 1);
    }

    #[tokio::test]
    async fn a_break_ends_the_stream_with_an_error_frame_and_settles_once() {
        // Cut at a frame boundary: the error frame follows directly.
        let up = upstream(vec![Ok(START), Err("connection reset by 127.0.0.1:9")]);
        let (mut body, reports) = metered(
            LlmBody::passthrough(up, Some(Protocol::Anthropic)),
            BodyKind::EventStream,
        );
        let (out, err) = collect(&mut body).await;
        assert!(err.is_none());
        let tail = out.strip_prefix(START).unwrap();
        assert!(tail.starts_with("event: error\n"), "{tail}");
        assert!(
            !tail.contains("127.0.0.1"),
            "the detail is logged, not sent: {tail}"
        );
        drop(body);
        assert_eq!(
            reports.lock().unwrap().len(),
            1,
            "settled once, not again on drop"
        );
    }

    #[tokio::test]
    async fn a_cut_mid_frame_is_closed_before_the_error_frame() {
        let up = upstream(vec![
            Ok(START),
            Ok("event: content_block_delta\ndata: {\"ty"),
            Err("reset"),
        ]);
        let mut body = LlmBody::passthrough(up, Some(Protocol::Anthropic));
        let (out, _) = collect(&mut body).await;
        assert!(out.ends_with("\n\n"));
        assert!(out.contains("data: {\"ty\n\nevent: error\n"), "{out}");
        let frame = out.rsplit("event: error\ndata: ").next().unwrap();
        let v: serde_json::Value = serde_json::from_str(frame.trim()).unwrap();
        assert_eq!(v["error"]["type"], "api_error");
    }

    #[tokio::test]
    async fn an_anthropic_stream_closed_before_message_stop_ends_with_an_error_frame() {
        // The upstream closes cleanly after a frame that is not the end (garbage, say).
        let up = upstream(vec![Ok(START), Ok("event: junk\ndata: not json\n\n")]);
        let mut body = LlmBody::passthrough(up, Some(Protocol::Anthropic));
        let (out, err) = collect(&mut body).await;
        assert!(err.is_none());
        assert!(out.ends_with("\n\n"), "{out}");
        assert!(
            out.rsplit("event: junk")
                .next()
                .unwrap()
                .contains("event: error\n"),
            "{out}"
        );
        // A complete stream whose `message_stop` (data-only, so the marker is there once) is
        // split across two chunks or across several short ones ends as it is.
        let end: &'static str = END.replacen("event: message_stop\n", "", 1).leak();
        let at = end.find("message_stop").unwrap();
        let splits = [
            vec![&end[..at + 4], &end[at + 4..]],
            vec![
                &end[..at + 2],
                &end[at + 2..at + 6],
                &end[at + 6..at + 9],
                &end[at + 9..],
            ],
        ];
        for parts in splits {
            let mut items = vec![Ok(START)];
            items.extend(parts.iter().map(|p| Ok(*p)));
            let mut body = LlmBody::passthrough(upstream(items), Some(Protocol::Anthropic));
            let (out, _) = collect(&mut body).await;
            assert!(out.ends_with(end) && !out.contains("event: error"), "{out}");
        }
    }

    #[tokio::test]
    async fn a_broken_json_body_aborts() {
        let up = upstream(vec![Ok("{\"type\":\"mess"), Err("reset")]);
        let (mut body, reports) = metered(LlmBody::passthrough(up, None), BodyKind::Json);
        let (out, err) = collect(&mut body).await;
        assert_eq!(out, "{\"type\":\"mess");
        assert!(err.is_some());
        assert!(body.next().await.is_none());
        drop(body);
        assert_eq!(reports.lock().unwrap().len(), 1);
    }

    const CHAT_1: &str = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"hi\"},\"finish_reason\":null}]}\n\n";
    const CHAT_2: &str = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3,\"total_tokens\":10}}\n\ndata: [DONE]\n\n";

    fn translator() -> Box<dyn StreamTranslator> {
        Box::new(ChatToAnthropic::new(ResponseOptions {
            model: Some("gpt".into()),
            ..ResponseOptions::default()
        }))
    }

    #[tokio::test]
    async fn translated_streams_end_cleanly_and_meter_what_the_client_gets() {
        let up = upstream(vec![Ok(CHAT_1), Ok(CHAT_2)]);
        let (mut body, reports) =
            metered(LlmBody::translated(up, translator()), BodyKind::EventStream);
        let (out, err) = collect(&mut body).await;
        assert!(err.is_none());
        assert!(out.starts_with("event: message_start\n"), "{out}");
        assert!(
            out.ends_with("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"),
            "{out}"
        );
        drop(body);
        let reports = reports.lock().unwrap();
        assert_eq!(reports.len(), 1);
        assert!(reports[0].complete);
        assert_eq!(reports[0].usage.output_tokens, 3);
    }

    #[tokio::test]
    async fn translated_streams_end_a_break_with_an_error_event() {
        let up = upstream(vec![Ok(CHAT_1), Err("reset by http://10.1.1.1:8000")]);
        let (mut body, reports) =
            metered(LlmBody::translated(up, translator()), BodyKind::EventStream);
        let (out, err) = collect(&mut body).await;
        assert!(err.is_none());
        assert!(out.contains("\"text\":\"hi\""), "{out}");
        let last = out.trim_end().rsplit("\n\n").next().unwrap();
        assert!(last.starts_with("event: error\n"), "{out}");
        assert!(
            !out.contains("message_stop") && !out.contains("http://"),
            "{out}"
        );
        drop(body);
        assert_eq!(reports.lock().unwrap().len(), 1);
    }

    const CHAT_USAGE: &str = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3,\"total_tokens\":10}}\n\n";

    /// An upstream that says when it was read to its end (the condition for its connection to
    /// go back to the pool).
    fn watched(
        items: Vec<&'static str>,
        then_stall: bool,
    ) -> (UpstreamStream, Arc<std::sync::atomic::AtomicBool>) {
        let ended = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = ended.clone();
        let items = futures_util::stream::iter(
            items
                .into_iter()
                .map(|s| Ok::<_, BodyError>(Bytes::from_static(s.as_bytes()))),
        );
        let tail: UpstreamStream = if then_stall {
            Box::pin(futures_util::stream::pending())
        } else {
            Box::pin(futures_util::stream::poll_fn(move |_| {
                flag.store(true, std::sync::atomic::Ordering::SeqCst);
                Poll::Ready(None)
            }))
        };
        (Box::pin(items.chain(tail)), ended)
    }

    /// Found by `bench proxy` (strace: a socket, a connect and a close per call): a translated
    /// stream ended the client's body as soon as its last event was written and dropped the
    /// upstream before its `[DONE]`, so every streamed call closed its upstream connection
    /// and the next opened a new one. The rest of the upstream is now read first.
    #[tokio::test]
    async fn a_complete_translated_stream_reads_the_upstream_to_its_end() {
        let (up, ended) = watched(vec![CHAT_1, CHAT_USAGE, "data: [DONE]\n\n"], false);
        let (mut body, reports) =
            metered(LlmBody::translated(up, translator()), BodyKind::EventStream);
        let (out, err) = collect(&mut body).await;
        assert!(err.is_none());
        assert!(
            out.ends_with("data: {\"type\":\"message_stop\"}\n\n"),
            "{out}"
        );
        assert!(
            ended.load(std::sync::atomic::Ordering::SeqCst),
            "the upstream body was dropped before its end"
        );
        assert_eq!(reports.lock().unwrap().len(), 1);
    }

    /// An upstream that keeps its body open after the answer costs its connection, not the
    /// client: the body ends after `DRAIN_WAIT`, and the meter settled when the last event went
    /// out, before that wait.
    #[tokio::test]
    async fn a_stalled_upstream_after_the_answer_does_not_hold_the_client() {
        let (up, _) = watched(vec![CHAT_1, CHAT_USAGE], true);
        let (mut body, reports) =
            metered(LlmBody::translated(up, translator()), BodyKind::EventStream);
        let mut out = String::new();
        while !out.contains("message_stop") {
            let chunk = body.next().await.unwrap().unwrap();
            out.push_str(std::str::from_utf8(&chunk).unwrap());
        }
        assert_eq!(
            reports.lock().unwrap().len(),
            1,
            "not settled at the last event"
        );
        let rest = tokio::time::timeout(std::time::Duration::from_secs(30), collect(&mut body))
            .await
            .expect("the body never ended");
        assert_eq!(rest.0, "");
        assert!(rest.1.is_none());
        assert_eq!(reports.lock().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn responses_streams_end_cleanly_or_with_response_failed() {
        let responses = || -> Box<dyn StreamTranslator> {
            Box::new(ChatToResponses::new(ResponsesOptions::default()))
        };
        let mut body = LlmBody::translated(upstream(vec![Ok(CHAT_1), Ok(CHAT_2)]), responses());
        let (out, err) = collect(&mut body).await;
        assert!(err.is_none());
        assert!(out.starts_with("event: response.created\n"), "{out}");
        let last = out.trim_end().rsplit("\n\n").next().unwrap();
        assert!(last.starts_with("event: response.completed\n"), "{out}");
        let mut body = LlmBody::translated(upstream(vec![Ok(CHAT_1), Err("reset")]), responses());
        let (out, err) = collect(&mut body).await;
        assert!(err.is_none());
        let last = out.trim_end().rsplit("\n\n").next().unwrap();
        assert!(last.starts_with("event: response.failed\n"), "{out}");
    }

    #[tokio::test]
    async fn ready_bodies_are_metered_once() {
        let json = r#"{"id":"m","type":"message","role":"assistant","model":"x","content":[],"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":4,"output_tokens":2}}"#;
        let (mut body, reports) = metered(
            LlmBody::ready(Bytes::from_static(json.as_bytes())),
            BodyKind::Json,
        );
        let (out, err) = collect(&mut body).await;
        assert!(err.is_none());
        assert_eq!(out, json);
        drop(body);
        let reports = reports.lock().unwrap();
        assert_eq!(reports.len(), 1);
        assert_eq!(reports[0].usage.output_tokens, 2);
    }
}
