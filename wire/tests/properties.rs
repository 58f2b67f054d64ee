//! Property tests: unknown fields survive parse and re-serialize; the SSE codec round-trips
//! under any chunking and line-ending style; streaming translation of any chunk split equals
//! the non-streamed translation of the same completion; the meter reads any chunking of a
//! stream the same; translated conversations keep OpenAI's tool-message ordering. The same for
//! the Responses translation: any content split of a stream completes with the non-streamed
//! response, any byte split of the upstream SSE gives the same events (which parse back from
//! the SSE we write), and translated Responses conversations keep every call and output.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use agentbox_wire::anthropic::{MessagesRequest, StreamEvent};
use agentbox_wire::chat::{ChatChunk, ChatMessage, ChatRequest, ChatResponse};
use agentbox_wire::responses::{ResponseStreamEvent, ResponsesRequest};
use agentbox_wire::sse::{self, Event};
use agentbox_wire::translate::{
    ChatOptions, ChatStreamTranslator, ResponseOptions, ResponsesOptions,
    ResponsesStreamTranslator, anthropic_into_chat, chat_to_anthropic_response,
    chat_to_responses_response, responses_into_chat,
};
use agentbox_wire::usage::UsageMeter;
use proptest::collection::{btree_map, vec};
use proptest::option;
use proptest::prelude::*;
use serde_json::{Map, Value, json};

// ---- generators ----------------------------------------------------------------------------

fn json_leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (-1.0e9f64..1.0e9).prop_map(Value::from),
        "[a-z \\n\"\\\\é😀]{0,8}".prop_map(Value::from),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    json_leaf().prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..4).prop_map(Value::Array),
            btree_map("[a-z_]{1,6}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Fields no type of ours names (`x_` never starts a real field).
fn unknown() -> impl Strategy<Value = Map<String, Value>> {
    btree_map("x_[a-z]{1,6}", json_value(), 0..3).prop_map(|m| m.into_iter().collect())
}

fn with(mut base: Value, extra: Map<String, Value>) -> Value {
    if let Value::Object(o) = &mut base {
        o.extend(extra);
    }
    base
}

fn text() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9 .,\\n\"\\\\{}é😀]{0,24}"
}

fn object() -> impl Strategy<Value = Value> {
    btree_map("[a-z_]{1,8}", json_value(), 0..4)
        .prop_map(|m| Value::Object(m.into_iter().collect()))
}

fn text_block() -> impl Strategy<Value = Value> {
    (text(), unknown()).prop_map(|(t, x)| with(json!({"type": "text", "text": t}), x))
}

fn image_block() -> impl Strategy<Value = Value> {
    let source = prop_oneof![
        ("[A-Za-z0-9+/]{0,16}", unknown()).prop_map(|(d, x)| with(
            json!({"type": "base64", "media_type": "image/png", "data": d}),
            x
        )),
        ("https://[a-z]{1,8}\\.com/[a-z]{1,8}", unknown())
            .prop_map(|(u, x)| with(json!({"type": "url", "url": u}), x)),
    ];
    (source, unknown()).prop_map(|(s, x)| with(json!({"type": "image", "source": s}), x))
}

fn block() -> impl Strategy<Value = Value> {
    prop_oneof![
        text_block(),
        image_block(),
        (
            "toolu_[a-z0-9]{1,8}",
            "[A-Za-z_]{1,10}",
            object(),
            unknown()
        )
            .prop_map(|(id, name, input, x)| with(
                json!({"type": "tool_use", "id": id, "name": name, "input": input}),
                x
            )),
        (
            "toolu_[a-z0-9]{1,8}",
            option::of(prop_oneof![
                text().prop_map(Value::from),
                vec(prop_oneof![text_block(), image_block()], 0..3).prop_map(Value::Array),
            ]),
            option::of(any::<bool>()),
            unknown()
        )
            .prop_map(|(id, content, is_error, x)| {
                let mut b = json!({"type": "tool_result", "tool_use_id": id});
                if let Some(c) = content {
                    b["content"] = c;
                }
                if let Some(e) = is_error {
                    b["is_error"] = json!(e);
                }
                with(b, x)
            }),
        (text(), option::of("[a-zA-Z0-9]{0,12}"), unknown()).prop_map(|(t, sig, x)| {
            let mut b = json!({"type": "thinking", "thinking": t});
            if let Some(s) = sig {
                b["signature"] = json!(s);
            }
            with(b, x)
        }),
        ("[a-z]{0,12}", unknown())
            .prop_map(|(d, x)| with(json!({"type": "redacted_thinking", "data": d}), x)),
        ("x_block_[a-z]{1,6}", unknown()).prop_map(|(t, x)| with(json!({"type": t}), x)),
    ]
}

fn content() -> impl Strategy<Value = Value> {
    prop_oneof![
        text().prop_map(Value::from),
        vec(block(), 0..4).prop_map(Value::Array)
    ]
}

fn message() -> impl Strategy<Value = Value> {
    (
        prop_oneof![Just("user"), Just("assistant"), Just("system")],
        content(),
        unknown(),
    )
        .prop_map(|(role, c, x)| with(json!({"role": role, "content": c}), x))
}

fn tool_def() -> impl Strategy<Value = Value> {
    (
        "[A-Za-z_]{1,10}",
        option::of(prop_oneof![Just("custom"), Just("web_search_20250305")]),
        option::of(text()),
        option::of(object()),
        unknown(),
    )
        .prop_map(|(name, kind, desc, schema, x)| {
            let mut t = json!({"name": name});
            if let Some(k) = kind {
                t["type"] = json!(k);
            }
            if let Some(d) = desc {
                t["description"] = json!(d);
            }
            if let Some(s) = schema {
                t["input_schema"] = s;
            }
            with(t, x)
        })
}

fn tool_choice() -> impl Strategy<Value = Value> {
    (
        prop_oneof![Just("auto"), Just("any"), Just("tool"), Just("none")],
        option::of(any::<bool>()),
        unknown(),
    )
        .prop_map(|(kind, disable, x)| {
            let mut c = json!({"type": kind});
            if kind == "tool" {
                c["name"] = json!("T");
            }
            if let (Some(d), true) = (disable, kind != "none") {
                c["disable_parallel_tool_use"] = json!(d);
            }
            with(c, x)
        })
}

fn number() -> impl Strategy<Value = Value> {
    prop_oneof![
        (0u8..=2).prop_map(Value::from),
        (0.0f64..2.0).prop_map(Value::from)
    ]
}

fn request() -> impl Strategy<Value = Value> {
    let head = (
        "[a-z0-9-]{1,12}",
        vec(message(), 0..6),
        option::of(prop_oneof![
            text().prop_map(Value::from),
            vec(text_block(), 0..3).prop_map(Value::Array)
        ]),
        option::of(1u32..100_000),
        option::of(vec(text(), 0..3)),
        option::of(any::<bool>()),
    );
    let tail = (
        option::of(number()),
        option::of(number()),
        option::of(0u32..100),
        option::of((option::of("[a-z0-9_]{1,12}"), unknown())),
        option::of(vec(tool_def(), 0..3)),
        option::of(tool_choice()),
        option::of(prop_oneof![
            (option::of(1024u32..64000), unknown()).prop_map(|(b, x)| {
                let mut t = json!({"type": "enabled"});
                if let Some(b) = b {
                    t["budget_tokens"] = json!(b);
                }
                with(t, x)
            }),
            unknown().prop_map(|x| with(json!({"type": "disabled"}), x)),
            unknown().prop_map(|x| with(json!({"type": "adaptive"}), x)),
        ]),
        unknown(),
    );
    (head, tail).prop_map(
        |(
            (model, messages, system, max_tokens, stops, stream),
            (temperature, top_p, top_k, metadata, tools, choice, thinking, x),
        )| {
            let mut r = json!({"model": model, "messages": messages});
            let mut put = |k: &str, v: Option<Value>| {
                if let Some(v) = v {
                    r[k] = v;
                }
            };
            put("system", system);
            put("max_tokens", max_tokens.map(Value::from));
            put("stop_sequences", stops.map(|s| json!(s)));
            put("stream", stream.map(Value::from));
            put("temperature", temperature);
            put("top_p", top_p);
            put("top_k", top_k.map(Value::from));
            put(
                "metadata",
                metadata.map(|(user, mx)| {
                    let mut m = json!({});
                    if let Some(u) = user {
                        m["user_id"] = json!(u);
                    }
                    with(m, mx)
                }),
            );
            put("tools", tools.map(Value::Array));
            put("tool_choice", choice);
            put("thinking", thinking);
            with(r, x)
        },
    )
}

// ---- a completion, for the streaming-equals-non-streaming property ------------------------

#[derive(Debug, Clone)]
struct Completion {
    reasoning: Option<String>,
    text: Option<String>,
    calls: Vec<(String, String, String)>,
    finish: &'static str,
    usage: Option<(u64, u64, u64)>,
}

fn completion() -> impl Strategy<Value = Completion> {
    (
        option::of("[a-z .😀é\\n]{1,30}"),
        option::of("[a-zA-Z .,😀é\\n\"]{1,40}"),
        vec(("call_[a-z0-9]{1,6}", "[A-Za-z_]{1,8}", object()), 0..3),
        prop_oneof![
            Just("stop"),
            Just("length"),
            Just("tool_calls"),
            Just("content_filter")
        ],
        option::of((0u64..100_000, 0u64..10_000, 0u64..100_000)),
    )
        .prop_map(|(reasoning, text, calls, finish, usage)| Completion {
            reasoning,
            text,
            // Distinct ids, as every upstream sends.
            calls: calls
                .into_iter()
                .enumerate()
                .map(|(i, (id, name, args))| (format!("{id}{i}"), name, args.to_string()))
                .collect(),
            finish,
            usage: usage.map(|(p, c, cached)| (p.max(cached), c, cached)),
        })
}

fn usage_json(u: (u64, u64, u64)) -> Value {
    json!({"prompt_tokens": u.0, "completion_tokens": u.1, "total_tokens": u.0 + u.1,
        "prompt_tokens_details": {"cached_tokens": u.2}})
}

fn whole_response(c: &Completion) -> ChatResponse {
    let mut message = json!({"role": "assistant", "content": c.text});
    if let Some(r) = &c.reasoning {
        message["reasoning_content"] = json!(r);
    }
    if !c.calls.is_empty() {
        message["tool_calls"] = c
            .calls
            .iter()
            .map(|(id, name, args)| {
                json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}})
            })
            .collect();
    }
    let mut r = json!({"id": "chatcmpl-p", "model": "up", "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": c.finish}]});
    if let Some(u) = c.usage {
        r["usage"] = usage_json(u);
    }
    serde_json::from_value(r).unwrap()
}

/// Splits `s` at the given fractions (on char boundaries) into non-empty pieces.
fn pieces(s: &str, cuts: &[u8]) -> Vec<String> {
    let chars: Vec<char> = s.chars().collect();
    let mut at: Vec<usize> = cuts
        .iter()
        .map(|c| usize::from(*c) * chars.len() / 256)
        .filter(|i| *i > 0 && *i < chars.len())
        .collect();
    at.sort_unstable();
    at.dedup();
    let mut out = Vec::new();
    let mut start = 0;
    for i in at.into_iter().chain(std::iter::once(chars.len())) {
        out.push(chars[start..i].iter().collect());
        start = i;
    }
    out.retain(|p: &String| !p.is_empty());
    out
}

fn stream_chunks(
    c: &Completion,
    cuts: &[u8],
    finish_with_last: bool,
    usage_with_finish: bool,
) -> Vec<ChatChunk> {
    let mk = |delta: Value, finish: Option<&str>| {
        json!({"id": "chatcmpl-p", "model": "up", "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    };
    let mut deltas = vec![json!({"role": "assistant", "content": ""})];
    if let Some(r) = &c.reasoning {
        deltas.extend(
            pieces(r, cuts)
                .into_iter()
                .map(|p| json!({"reasoning_content": p})),
        );
    }
    if let Some(t) = &c.text {
        deltas.extend(pieces(t, cuts).into_iter().map(|p| json!({"content": p})));
    }
    for (i, (id, name, args)) in c.calls.iter().enumerate() {
        let mut parts = pieces(args, cuts).into_iter();
        let first = parts.next().unwrap_or_default();
        deltas.push(
            json!({"tool_calls": [{"index": i, "id": id, "type": "function",
            "function": {"name": name, "arguments": first}}]}),
        );
        deltas.extend(
            parts.map(|p| json!({"tool_calls": [{"index": i, "function": {"arguments": p}}]})),
        );
    }
    let mut chunks: Vec<Value> = deltas.into_iter().map(|d| mk(d, None)).collect();
    if finish_with_last {
        if let Some(last) = chunks.last_mut() {
            last["choices"][0]["finish_reason"] = json!(c.finish);
        }
    } else {
        chunks.push(mk(json!({}), Some(c.finish)));
    }
    if let Some(u) = c.usage {
        if usage_with_finish {
            if let Some(last) = chunks.last_mut() {
                last["usage"] = usage_json(u);
            }
        } else {
            chunks.push(
                json!({"id": "chatcmpl-p", "model": "up", "choices": [], "usage": usage_json(u)}),
            );
        }
    }
    chunks
        .into_iter()
        .map(|v| serde_json::from_value(v).unwrap())
        .collect()
}

/// How a completion is streamed: where its text and arguments are cut, whether the finish
/// reason rides on the last content chunk and the usage on the finish chunk, whether `[DONE]`
/// ends the stream.
#[derive(Debug, Clone)]
struct Split {
    cuts: Vec<u8>,
    finish_with_last: bool,
    usage_with_finish: bool,
    done_marker: bool,
}

fn split() -> impl Strategy<Value = Split> {
    (
        vec(any::<u8>(), 0..6),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(
            |(cuts, finish_with_last, usage_with_finish, done_marker)| Split {
                cuts,
                finish_with_last,
                usage_with_finish,
                done_marker,
            },
        )
}

/// `c` streamed as `s` says through `t`, after the `first` events; the events.
fn stream<T: common::Translator>(
    t: &mut T,
    first: Vec<T::Event>,
    c: &Completion,
    s: &Split,
) -> Vec<T::Event> {
    let chunks = stream_chunks(c, &s.cuts, s.finish_with_last, s.usage_with_finish);
    common::feed_chunks(t, first, chunks, s.done_marker)
}

// ---- a Responses conversation ---------------------------------------------------------------

fn responses_item() -> impl Strategy<Value = Value> {
    let part = prop_oneof![
        text().prop_map(|t| json!({"type": "input_text", "text": t})),
        text().prop_map(|t| json!({"type": "output_text", "text": t, "annotations": []})),
        Just(json!({"type": "input_image", "image_url": "data:image/png;base64,AAAA"})),
    ];
    let content = prop_oneof![
        text().prop_map(Value::from),
        vec(part, 0..3).prop_map(Value::Array)
    ];
    prop_oneof![
        (
            prop_oneof![
                Just("user"),
                Just("assistant"),
                Just("developer"),
                Just("system"),
                Just("critic")
            ],
            content.clone()
        )
            .prop_map(|(role, content)| json!({"type": "message", "role": role, "content": content})),
        ("[a-z]{1,6}", object()).prop_map(|(name, args)| {
            json!({"type": "function_call", "call_id": "", "name": name, "arguments": args.to_string()})
        }),
        content.prop_map(|output| json!({"type": "function_call_output", "call_id": "", "output": output})),
        text().prop_map(|t| json!({"type": "reasoning", "summary": [{"type": "summary_text", "text": t}]})),
        text().prop_map(|t| json!({"type": "custom_tool_call", "call_id": "c", "name": "apply_patch", "input": t})),
    ]
}

/// A Responses request whose calls and outputs have distinct call ids (`call_<n>`, `out_<n>`).
fn responses_request() -> impl Strategy<Value = Value> {
    (option::of(text()), vec(responses_item(), 0..12)).prop_map(|(instructions, mut items)| {
        for (i, item) in items.iter_mut().enumerate() {
            match item["type"].as_str() {
                Some("function_call") => item["call_id"] = json!(format!("call_{i}")),
                Some("function_call_output") => item["call_id"] = json!(format!("out_{i}")),
                Some(_) | None => {}
            }
        }
        let mut req = json!({"model": "m", "input": items});
        if let Some(text) = instructions {
            req["instructions"] = json!(text);
        }
        req
    })
}

fn responses_opts() -> ResponsesOptions {
    ResponsesOptions {
        created_at: Some(1_700_000_000),
        ..ResponsesOptions::default()
    }
}

/// The chunks as the upstream's SSE bytes.
fn chunks_as_sse(chunks: &[ChatChunk], done_marker: bool) -> Vec<u8> {
    let mut bytes = Vec::new();
    for c in chunks {
        bytes.extend_from_slice(b"data: ");
        bytes.extend_from_slice(&serde_json::to_vec(c).unwrap());
        bytes.extend_from_slice(b"\n\n");
    }
    if done_marker {
        bytes.extend_from_slice(b"data: [DONE]\n\n");
    }
    bytes
}

// ---- SSE events ----------------------------------------------------------------------------

fn sse_event() -> impl Strategy<Value = Event> {
    (
        "[a-z_.]{0,12}",
        "[a-zA-Z0-9 :{}\"\\n😀é]{0,30}",
        option::of("[a-zA-Z0-9 :_-]{0,8}"),
        option::of(0u64..100_000),
    )
        .prop_map(|(event, data, id, retry)| Event {
            event,
            data,
            id,
            retry,
        })
}

fn split_at_cuts(bytes: &[u8], cuts: &[u16]) -> Vec<Vec<u8>> {
    let mut at: Vec<usize> = cuts
        .iter()
        .map(|c| usize::from(*c) % (bytes.len() + 1))
        .collect();
    at.sort_unstable();
    let mut out = Vec::new();
    let mut start = 0;
    for i in at.into_iter().chain(std::iter::once(bytes.len())) {
        out.push(bytes[start..i].to_vec());
        start = i;
    }
    out
}

proptest! {

    #[test]
    fn anthropic_request_with_unknown_fields_survives_parse_and_serialize(v in request()) {
        let parsed: MessagesRequest = serde_json::from_value(v.clone()).unwrap();
        prop_assert_eq!(serde_json::to_value(&parsed).unwrap(), v.clone());
        // And through bytes, as a proxy does it.
        let bytes = serde_json::to_vec(&v).unwrap();
        let parsed: MessagesRequest = serde_json::from_slice(&bytes).unwrap();
        prop_assert_eq!(serde_json::to_value(&parsed).unwrap(), v);
    }

    #[test]
    fn chat_bodies_with_unknown_fields_survive(c in completion(), top in unknown(), choice in unknown(), msg in unknown()) {
        let mut resp = serde_json::to_value(whole_response(&c)).unwrap();
        resp.as_object_mut().unwrap().extend(top.clone());
        resp["choices"][0].as_object_mut().unwrap().extend(choice);
        resp["choices"][0]["message"].as_object_mut().unwrap().extend(msg.clone());
        let parsed: ChatResponse = serde_json::from_value(resp.clone()).unwrap();
        prop_assert_eq!(serde_json::to_value(&parsed).unwrap(), resp);

        for chunk in stream_chunks(&c, &[7, 99, 200], false, false) {
            let mut v = serde_json::to_value(&chunk).unwrap();
            v.as_object_mut().unwrap().extend(top.clone());
            let parsed: ChatChunk = serde_json::from_value(v.clone()).unwrap();
            prop_assert_eq!(serde_json::to_value(&parsed).unwrap(), v);
        }

        let mut req = json!({"model": "m", "messages": [with(json!({"role": "user", "content": "hi"}), msg)]});
        req.as_object_mut().unwrap().extend(top);
        let parsed: ChatRequest = serde_json::from_value(req.clone()).unwrap();
        prop_assert_eq!(serde_json::to_value(&parsed).unwrap(), req);
    }

    #[test]
    fn sse_decode_of_encode_is_identity_for_any_chunking(
        events in vec(sse_event(), 0..8),
        comments in vec(any::<bool>(), 8),
        cuts in vec(any::<u16>(), 0..12),
        newline in prop_oneof![Just("\n"), Just("\r\n"), Just("\r")],
        bom in any::<bool>(),
    ) {
        let encoder = sse::Encoder::new();
        let mut bytes = Vec::new();
        if bom {
            bytes.extend_from_slice("\u{FEFF}".as_bytes());
        }
        for (e, comment) in events.iter().zip(comments.iter().chain(std::iter::repeat(&false))) {
            if *comment {
                encoder.comment("keep-alive", &mut bytes);
            }
            encoder.encode(e, &mut bytes);
        }
        let text = String::from_utf8(bytes).unwrap().replace('\n', newline);
        let mut decoder = sse::Decoder::new();
        let mut out = Vec::new();
        for piece in split_at_cuts(text.as_bytes(), &cuts) {
            decoder.feed(&piece, &mut out).unwrap();
        }
        prop_assert_eq!(out, events);
        prop_assert!(!decoder.has_pending());
    }

    #[test]
    fn streaming_translation_of_any_split_equals_non_streaming(c in completion(), s in split()) {
        let whole = chat_to_anthropic_response(whole_response(&c), &ResponseOptions::default()).unwrap();
        let mut t = ChatStreamTranslator::new(ResponseOptions::default());
        let events = stream(&mut t, Vec::new(), &c, &s);
        let streamed = common::accumulate(&events);
        prop_assert_eq!(streamed, whole);
    }

    #[test]
    fn responses_streaming_of_any_split_equals_non_streaming(
        c in completion(),
        s in split(),
        start_early in any::<bool>(),
    ) {
        let whole = chat_to_responses_response(whole_response(&c), &responses_opts()).unwrap();
        let mut t = ResponsesStreamTranslator::new(responses_opts());
        // Started before any chunk, the id is a fresh one: compared apart below.
        let first = if start_early { t.start() } else { Vec::new() };
        let events = stream(&mut t, first, &c, &s);
        let mut streamed = common::check_responses_stream(&events);
        prop_assert_eq!(t.final_usage(), streamed.usage.as_ref());
        if start_early {
            let fresh = streamed.id.clone();
            prop_assert!(fresh.starts_with("resp_"));
            let v = serde_json::to_string(&streamed).unwrap();
            let base = fresh.trim_start_matches("resp_");
            streamed = serde_json::from_str(&v.replace(base, "chatcmpl-p")).unwrap();
            streamed.id = whole.id.clone();
        }
        prop_assert_eq!(streamed, whole);
    }

    /// The translators read a chunk's `data:` text through a lean view (only the members they
    /// use) rather than the full [`ChatChunk`] with its extras: the events are the same, whatever
    /// unknown members the upstream adds at any level, with `created` and `stop_reason` (extras
    /// they do read) given, and `stop_reason` present, null or absent.
    #[test]
    fn events_from_data_text_equal_events_from_the_parsed_chunk(
        c in completion(),
        top in unknown(),
        choice in unknown(),
        delta in unknown(),
        created in 0u64..2_000_000_000,
        stop in option::of(prop_oneof![Just(Value::Null), Just(json!("END")), Just(json!(7))]),
    ) {
        let mut values = Vec::new();
        for chunk in stream_chunks(&c, &[7, 99, 200], false, false) {
            let mut v = serde_json::to_value(&chunk).unwrap();
            let o = v.as_object_mut().unwrap();
            o.extend(top.clone());
            o.insert("created".into(), created.into());
            if let Some(ch) = v["choices"].get_mut(0).and_then(Value::as_object_mut) {
                ch.extend(choice.clone());
                if let Some(stop) = &stop {
                    ch.insert("stop_reason".into(), stop.clone());
                }
                if let Some(d) = ch.get_mut("delta").and_then(Value::as_object_mut) {
                    d.extend(delta.clone());
                }
            }
            values.push(v);
        }
        let parsed = || values.iter().map(|v| serde_json::from_value::<ChatChunk>(v.clone()).unwrap());

        // A stop sequence the upstream may name, so `stop_reason` matters to the answer.
        let opts = || ResponseOptions { stop_sequences: vec!["END".into()], ..ResponseOptions::default() };
        let mut direct = ChatStreamTranslator::new(opts());
        let mut expected: Vec<StreamEvent> = parsed().flat_map(|c| direct.push_chunk(c)).collect();
        expected.extend(direct.finish());
        let mut t = ChatStreamTranslator::new(opts());
        let mut got: Vec<StreamEvent> = values.iter().flat_map(|v| t.push_data(&v.to_string())).collect();
        got.extend(t.finish());
        prop_assert_eq!(&got, &expected);

        // No `created_at` of ours, so the upstream's `created` is the one reported.
        let mut direct = ResponsesStreamTranslator::new(ResponsesOptions::default());
        let mut expected: Vec<ResponseStreamEvent> = parsed().flat_map(|c| direct.push_chunk(c)).collect();
        expected.extend(direct.finish());
        let mut t = ResponsesStreamTranslator::new(ResponsesOptions::default());
        let mut got: Vec<ResponseStreamEvent> = values.iter().flat_map(|v| t.push_data(&v.to_string())).collect();
        got.extend(t.finish());
        prop_assert_eq!(&got, &expected);
    }

    #[test]
    fn responses_events_are_the_same_for_any_byte_split_of_the_upstream_sse(
        c in completion(),
        cuts in vec(any::<u16>(), 0..16),
        done_marker in any::<bool>(),
    ) {
        let chunks = stream_chunks(&c, &[60, 190], false, false);
        let mut direct = ResponsesStreamTranslator::new(responses_opts());
        let expected = common::feed_chunks(&mut direct, Vec::new(), chunks.clone(), done_marker);

        let bytes = chunks_as_sse(&chunks, done_marker);
        let mut decoder = sse::Decoder::new();
        let mut t = ResponsesStreamTranslator::new(responses_opts());
        let mut got = Vec::new();
        for piece in split_at_cuts(&bytes, &cuts) {
            let mut frames = Vec::new();
            decoder.feed(&piece, &mut frames).unwrap();
            for f in frames {
                got.extend(t.push_data(&f.data));
            }
        }
        got.extend(t.finish());
        prop_assert_eq!(&got, &expected);

        // What we write parses back, event for event, under the name it says.
        let mut out = Vec::new();
        for e in &got {
            e.write_sse(&mut out).unwrap();
        }
        let mut frames = Vec::new();
        let mut decoder = sse::Decoder::new();
        for piece in split_at_cuts(&out, &cuts) {
            decoder.feed(&piece, &mut frames).unwrap();
        }
        prop_assert_eq!(frames.len(), got.len());
        for (f, e) in frames.iter().zip(&got) {
            let back: ResponseStreamEvent = serde_json::from_str(&f.data).unwrap();
            prop_assert_eq!(&back, e);
            prop_assert_eq!(f.event.as_str(), e.event_name());
        }
    }

    #[test]
    fn translated_responses_requests_keep_every_call_and_output(v in responses_request()) {
        let req: ResponsesRequest = serde_json::from_value(v.clone()).unwrap();
        let chat = responses_into_chat(req, &ChatOptions::default()).unwrap();
        let items = v["input"].as_array().unwrap();
        let ids_of = |kind: &str| -> Vec<String> {
            items.iter().filter(|i| i["type"] == kind)
                .map(|i| i["call_id"].as_str().unwrap().to_owned()).collect()
        };
        let mut calls = Vec::new();
        let mut outputs = Vec::new();
        for (i, m) in chat.messages.iter().enumerate() {
            match m {
                ChatMessage::System { .. } => prop_assert_eq!(i, 0, "one leading system message"),
                ChatMessage::Assistant { tool_calls, content, .. } => {
                    let tool_calls = tool_calls.as_deref().unwrap_or_default();
                    prop_assert!(content.is_some() || !tool_calls.is_empty());
                    calls.extend(tool_calls.iter().map(|c| c.id.clone()));
                }
                ChatMessage::Tool { tool_call_id, .. } => outputs.push(tool_call_id.clone()),
                ChatMessage::User { .. } => {}
                ChatMessage::Developer { .. } | ChatMessage::Other(_) => {
                    prop_assert!(false, "unexpected message {m:?}");
                }
            }
        }
        prop_assert_eq!(calls, ids_of("function_call"));
        prop_assert_eq!(outputs, ids_of("function_call_output"));
        let may_have_system = v.get("instructions").is_some()
            || items.iter().any(|i| i["role"] == "developer" || i["role"] == "system");
        let starts_with_system = matches!(chat.messages.first(), Some(ChatMessage::System { .. }));
        prop_assert!(may_have_system || !starts_with_system);
    }

    #[test]
    fn meter_reads_any_chunking_of_a_translated_stream(
        c in completion(),
        cuts in vec(any::<u16>(), 0..16),
    ) {
        let mut t = ChatStreamTranslator::new(ResponseOptions::default());
        let mut events: Vec<StreamEvent> = Vec::new();
        for chunk in stream_chunks(&c, &[50, 150], false, false) {
            events.extend(t.push_chunk(chunk));
        }
        events.extend(t.finish());
        let mut bytes = Vec::new();
        for e in &events {
            e.write_sse(&mut bytes).unwrap();
        }
        let mut meter = UsageMeter::event_stream();
        for piece in split_at_cuts(&bytes, &cuts) {
            meter.feed(&piece);
        }
        let report = meter.finish();
        let expected = t.final_usage().unwrap();
        prop_assert!(report.complete);
        prop_assert_eq!(report.usage.input_tokens, expected.input_tokens);
        prop_assert_eq!(report.usage.output_tokens, expected.output_tokens);
        prop_assert_eq!(Some(report.usage.cache_read_input_tokens), expected.cache_read_input_tokens);
    }

    #[test]
    fn translated_requests_keep_every_tool_result_and_fold_every_system_message(v in request()) {
        let blocks_of = |role: &str, kind: &str| -> usize {
            v["messages"].as_array().unwrap().iter()
                .filter(|m| m["role"] == role)
                .filter_map(|m| m["content"].as_array())
                .flatten()
                .filter(|b| b["type"] == kind)
                .count()
        };
        // Blocks in the wrong turn are refused by Anthropic too; skip such inputs.
        prop_assume!(blocks_of("assistant", "tool_result") == 0 && blocks_of("user", "tool_use") == 0);
        let results = blocks_of("user", "tool_result");
        let req: MessagesRequest = serde_json::from_value(v).unwrap();
        let chat = anthropic_into_chat(req, &ChatOptions::default()).unwrap();
        let tools = chat.messages.iter().filter(|m| matches!(m, ChatMessage::Tool { .. })).count();
        prop_assert_eq!(tools, results);
        // No mid-conversation system message survives folding.
        let inline_system = chat
            .messages
            .iter()
            .skip(1)
            .any(|m| matches!(m, ChatMessage::System { .. }));
        prop_assert!(!inline_system, "a system message after the first");
    }
}

/// Tool messages land right after the assistant turn whose calls they answer, before the
/// user's own text, for well-formed conversations.
#[test]
fn tool_results_follow_their_calls_in_a_claude_code_shaped_conversation() {
    let req: MessagesRequest =
        serde_json::from_value(json!({"model": "m", "max_tokens": 100, "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "text", "text": "ok"},
                {"type": "tool_use", "id": "a", "name": "Read", "input": {}},
                {"type": "tool_use", "id": "b", "name": "Read", "input": {}}]},
            {"role": "user", "content": [{"type": "text", "text": "<reminder>"},
                {"type": "tool_result", "tool_use_id": "a", "content": "A"},
                {"type": "tool_result", "tool_use_id": "b", "content": "B"}]}
        ]}))
        .unwrap();
    let chat = anthropic_into_chat(req, &ChatOptions::default()).unwrap();
    let v = serde_json::to_value(&chat.messages).unwrap();
    assert_eq!(v[1]["role"], "assistant");
    assert_eq!(
        v[2],
        json!({"role": "tool", "tool_call_id": "a", "content": "A"})
    );
    assert_eq!(
        v[3],
        json!({"role": "tool", "tool_call_id": "b", "content": "B"})
    );
    assert_eq!(v[4], json!({"role": "user", "content": "<reminder>"}));
}
