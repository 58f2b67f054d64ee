//! What the fuzz targets share: cutting an input into network chunks, decoding SSE, driving the
//! stream translators and checking what they emit against the Anthropic stream contract, and a
//! validated config for the daemons' request checks.
//!
//! A panic here is a finding: the helpers assert the properties every caller of `agentbox-wire`
//! relies on, not only that nothing crashes.

use std::sync::OnceLock;

use agentbox_policy::config::{Config, FixedEnv};
use agentbox_wire::anthropic::{StopReason, StreamAccumulator, StreamEvent, StreamViolation};
use agentbox_wire::sse::{Decoder, Encoder, Event};
use agentbox_wire::translate::{
    ChatStreamTranslator, ResponseOptions, ResponsesOptions, ResponsesStreamTranslator,
};
use agentbox_wire::usage::UsageMeter;

/// `bytes` cut into pieces of 1 to 64 bytes, lengths drawn from `seed` (0: one piece). Any
/// split must decode the same; a seed in the input's fixed-size head keeps the rest of the
/// input the payload itself, so the corpus can be seeded with real files.
pub fn pieces(bytes: &[u8], seed: u32) -> Vec<&[u8]> {
    if seed == 0 {
        return vec![bytes];
    }
    let mut state = seed;
    let mut out = Vec::new();
    let mut rest = bytes;
    while !rest.is_empty() {
        // xorshift32: deterministic, so a crash reproduces from its input.
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        let n = (state % 64) as usize + 1;
        let (head, tail) = rest.split_at(n.min(rest.len()));
        out.push(head);
        rest = tail;
    }
    out
}

/// The events of `chunks` through one decoder (a small event limit, so the limit path is
/// reached too), or `None` if the decoder refused the stream.
pub fn decode(chunks: &[&[u8]], limit: usize) -> Option<Vec<Event>> {
    let mut d = Decoder::with_max_event_bytes(limit);
    let mut out = Vec::new();
    for c in chunks {
        d.feed(c, &mut out).ok()?;
    }
    Some(out)
}

/// `events` written by the encoder.
pub fn encode(events: &[Event]) -> Vec<u8> {
    let mut out = Vec::new();
    for e in events {
        Encoder::new().encode(e, &mut out);
    }
    out
}

/// Feeds the SSE `data` payloads to both stream translators (Anthropic and Responses output)
/// and finishes them; checks the Anthropic events against the stream contract.
pub fn translate_chat_stream(datas: &[String], opts: ResponseOptions, start_early: bool) {
    let mut anthropic = ChatStreamTranslator::new(opts.clone());
    let mut responses = ResponsesStreamTranslator::new(ResponsesOptions {
        model: opts.model.clone(),
        response_id: opts.message_id.clone(),
        created_at: Some(1_700_000_000),
        input_tokens_estimate: opts.input_tokens_estimate,
    });
    let mut events = Vec::new();
    let mut sse = Vec::new();
    if start_early {
        events.extend(anthropic.start());
        for e in responses.start() {
            write_responses(&e, &mut sse);
        }
    }
    for data in datas {
        events.extend(anthropic.push_data(data));
        for e in responses.push_data(data) {
            write_responses(&e, &mut sse);
        }
    }
    events.extend(anthropic.finish());
    for e in responses.finish() {
        write_responses(&e, &mut sse);
    }
    assert!(
        anthropic.is_done(),
        "finish() left the Anthropic stream open"
    );
    assert!(
        responses.is_done(),
        "finish() left the Responses stream open"
    );
    assert!(
        decode(&[&sse], usize::MAX).is_some(),
        "the Responses events do not decode as SSE"
    );
    check_anthropic_events(&events);
}

fn write_responses(e: &agentbox_wire::responses::ResponseStreamEvent, out: &mut Vec<u8>) {
    e.write_sse(out)
        .unwrap_or_else(|err| panic!("a Responses event does not serialize: {err}"));
}

/// What a translator emits must be a stream a client accepts: it may end in an error event
/// (the upstream broke), never in a malformed sequence. The SSE it is written as must decode
/// back to the same events.
pub fn check_anthropic_events(events: &[StreamEvent]) {
    let cut_at_max_tokens = events.iter().any(|e| {
        matches!(e, StreamEvent::MessageDelta { delta, .. }
            if delta.stop_reason == Some(StopReason::MaxTokens))
    });
    let mut acc = StreamAccumulator::new();
    let mut wire = Vec::new();
    for e in events {
        e.write_sse(&mut wire)
            .unwrap_or_else(|err| panic!("an Anthropic event does not serialize: {err}"));
        match acc.push(e) {
            Ok(()) => {}
            Err(StreamViolation::ErrorEvent(_)) => return,
            // Arguments are streamed as the model wrote them: a model's malformed JSON reaches
            // the client as it would from Anthropic, but arguments cut mid-value only when the
            // output was cut at max_tokens.
            Err(StreamViolation::ToolInputInvalid { reason, .. })
                if cut_at_max_tokens || !reason.starts_with("EOF while parsing") =>
            {
                return;
            }
            Err(v) => {
                panic!("the translator broke the Anthropic stream contract: {v}\n{events:#?}")
            }
        }
    }
    let message = acc.finish().unwrap_or_else(|v| {
        panic!("the translated Anthropic stream does not finish: {v}\n{events:#?}")
    });
    let back = decode(&[&wire], usize::MAX).unwrap_or_else(|| panic!("own SSE does not decode"));
    assert_eq!(
        back.len(),
        events.len(),
        "own SSE decodes to another event count"
    );
    // The gateway meters these bytes: it must bill what the message says, and at least that
    // where the usage is the translator's estimate (`ESTIMATE_MARK`: the meter's floors apply).
    let mut meter = UsageMeter::event_stream();
    meter.feed(&wire);
    let billed = meter.finish().billable_usage();
    let u = &message.usage;
    if agentbox_wire::anthropic::is_estimate(&u.extra) {
        assert!(
            billed.input_tokens >= u.input_tokens && billed.output_tokens >= u.output_tokens,
            "the meter bills less than the stream's estimate: {billed:?} < {u:?}"
        );
    } else {
        assert_eq!(
            (billed.input_tokens, billed.output_tokens),
            (u.input_tokens, u.output_tokens),
            "the meter reads other usage than the stream carries"
        );
    }
    assert_eq!(
        (
            billed.cache_read_input_tokens,
            billed.cache_creation_input_tokens
        ),
        (
            u.cache_read_input_tokens.unwrap_or(0),
            u.cache_creation_input_tokens.unwrap_or(0)
        ),
        "the meter reads other cache usage than the stream carries"
    );
}

/// The example config (`packaging/agentbox.example.toml`), validated once: what the daemons'
/// request checks read (models, the env allowlist).
pub fn example_config() -> &'static Config {
    static CONFIG: OnceLock<Config> = OnceLock::new();
    CONFIG.get_or_init(|| {
        let text = include_str!("../../packaging/agentbox.example.toml");
        Config::from_toml_str(text, "agentbox.example.toml", &FixedEnv::default())
            .unwrap_or_else(|e| panic!("the example config is invalid: {e}"))
    })
}

/// Translation settings picked by the input's bits, so every option combination is reached.
pub fn chat_options(bits: u16) -> agentbox_wire::translate::ChatOptions {
    use agentbox_wire::translate::{ChatOptions, InlineSystem, MaxTokensField, ReasoningField};
    let on = |bit: u16| bits & (1 << bit) != 0;
    ChatOptions {
        model: on(0).then(|| "upstream-model".to_owned()),
        max_output_tokens: on(1).then_some(u64::from(bits >> 8)),
        max_tokens_field: match (on(2), on(3)) {
            (false, false) => MaxTokensField::MaxCompletionTokens,
            (true, false) => MaxTokensField::MaxTokens,
            (false | true, true) => MaxTokensField::Both,
        },
        include_usage: on(4),
        strip_billing_header: on(5),
        inline_system: if on(6) {
            InlineSystem::Keep
        } else {
            InlineSystem::Fold
        },
        reasoning_passback: on(7),
        reasoning: match (on(1), on(8)) {
            (false, false) => ReasoningField::None,
            (true, false) => ReasoningField::ReasoningEffort,
            (_, true) => ReasoningField::Reasoning,
        },
        forward_user: on(9),
        forward_top_k: on(2),
    }
}

/// Whether `bytes` mean the same `T` read directly and through a `Value` (which keeps the last
/// of duplicated members): false only when a member named twice changed the typed reading.
pub fn no_duplicate_members<T>(bytes: &[u8], direct: &T) -> bool
where
    T: serde::de::DeserializeOwned + PartialEq,
{
    serde_json::from_slice::<serde_json::Value>(bytes)
        .ok()
        .and_then(|v| serde_json::from_value::<T>(v).ok())
        .is_some_and(|via_value| &via_value == direct)
}

/// `bytes` read as a request `T`, checked to survive serialize and parse again unchanged (for
/// bodies without duplicated members, see [`no_duplicate_members`]); `None` if not a `T`.
pub fn parsed_round_trip<T>(bytes: &[u8]) -> Option<T>
where
    T: serde::de::DeserializeOwned + serde::Serialize + PartialEq + std::fmt::Debug,
{
    let req: T = serde_json::from_slice(bytes).ok()?;
    let text = serde_json::to_vec(&req).expect("a parsed request serializes");
    let back: T = serde_json::from_slice(&text).expect("own output parses");
    if no_duplicate_members(bytes, &req) {
        assert_eq!(req, back, "parse and serialize lost something");
    }
    Some(req)
}
