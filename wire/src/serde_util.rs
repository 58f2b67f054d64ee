//! Serde building blocks shared by the wire types: the "string or list" shape every LLM API
//! uses for content, fixed `type` tags that need no value from the caller, [`RawJson`] for
//! opaque values, and [`text`], the writer of long strings.
//!
//! They exist for speed on the proxy's and the bridge's hot path, a 100 KB agent request parsed,
//! translated and written again per model call. `TextOrList` is hand-written instead of
//! `#[serde(untagged)]` because untagged enums buffer the whole value before trying each
//! variant, and message content is where such a request spends its bytes. Tool schemas are
//! kept as [`RawJson`] (checked, never built into a tree of maps: that tree cost more than the
//! rest of the parse). Long strings are escaped eight bytes at a time by [`text`]: serde_json
//! looks at every byte, which made writing the translated body the largest single cost.

use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::ser::{SerializeStruct, Serializer};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

/// A JSON value that is either a plain string or a list of items, as in Anthropic's
/// `content: "hi"` vs `content: [{"type":"text","text":"hi"}]`. Which form arrived is kept so a
/// re-serialized body has the same shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TextOrList<T> {
    Text(String),
    List(Vec<T>),
}

impl<T> Default for TextOrList<T> {
    fn default() -> Self {
        TextOrList::List(Vec::new())
    }
}

impl<T> From<String> for TextOrList<T> {
    fn from(s: String) -> Self {
        TextOrList::Text(s)
    }
}

impl<T> From<&str> for TextOrList<T> {
    fn from(s: &str) -> Self {
        TextOrList::Text(s.to_owned())
    }
}

impl<T> From<Vec<T>> for TextOrList<T> {
    fn from(v: Vec<T>) -> Self {
        TextOrList::List(v)
    }
}

impl<T: Serialize> Serialize for TextOrList<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            TextOrList::Text(s) => text(s, serializer),
            TextOrList::List(items) => items.serialize(serializer),
        }
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for TextOrList<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = TextOrList<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or an array")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(TextOrList::Text(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(TextOrList::Text(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(TextOrList::List(items))
            }
        }
        deserializer.deserialize_any(V(PhantomData))
    }
}

/// Strings shorter than this go through serde_json's own writer (the detour through a raw
/// value costs an allocation).
const LONG_TEXT: usize = 256;

/// The struct (and field) name under which serde_json's serializers take a value's JSON text
/// as it is (what `RawValue` serializes as). Handing the escaped text over this way skips building a
/// `RawValue`, which would check the text by parsing it again. If serde_json ever changed the
/// name, the text would come out as a string of escaped JSON: the tests below compare every
/// output with serde_json's own, so that cannot pass unnoticed.
const RAW_VALUE_TOKEN: &str = "$serde_json::private::RawValue";

/// Writes a string as serde_json does, byte for byte, but scans long ones eight bytes at a time
/// for the bytes JSON must escape (`"`, backslash, controls) and hands the escaped text over as
/// raw JSON. Use as `#[serde(serialize_with = "...")]` on fields that may hold long text. (A
/// serializer other than serde_json's sees a struct holding the escaped text; serde_json's
/// `to_value` reads it back as the string; nothing else serializes these types.)
pub fn text<S: Serializer>(s: &str, serializer: S) -> Result<S::Ok, S::Error> {
    if s.len() < LONG_TEXT {
        return serializer.serialize_str(s);
    }
    let mut out = String::with_capacity(s.len() + s.len() / 16 + 2);
    out.push('"');
    escape_into(&mut out, s);
    out.push('"');
    let mut raw = serializer.serialize_struct(RAW_VALUE_TOKEN, 1)?;
    raw.serialize_field(RAW_VALUE_TOKEN, out.as_str())?;
    raw.end()
}

/// [`text`] for an optional field (with `skip_serializing_if = "Option::is_none"`).
pub fn opt_text<S: Serializer>(s: &Option<String>, serializer: S) -> Result<S::Ok, S::Error> {
    match s {
        Some(s) => text(s, serializer),
        None => serializer.serialize_none(),
    }
}

/// A [`serde_json::Value`] written exactly as serde_json writes it, its long strings through
/// [`text`]: for the passthrough paths, which forward a whole parsed request (message text is
/// most of its bytes, and serde_json's writer looks at them one at a time).
#[derive(Debug)]
pub struct FastValue<'a>(pub &'a serde_json::Value);

impl Serialize for FastValue<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::{SerializeMap, SerializeSeq};
        use serde_json::Value;
        match self.0 {
            Value::String(s) => text(s, serializer),
            Value::Array(items) => {
                let mut seq = serializer.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(&FastValue(item))?;
                }
                seq.end()
            }
            Value::Object(map) => {
                let mut out = serializer.serialize_map(Some(map.len()))?;
                for (k, v) in map {
                    out.serialize_entry(k, &FastValue(v))?;
                }
                out.end()
            }
            Value::Null | Value::Bool(_) | Value::Number(_) => self.0.serialize(serializer),
        }
    }
}

const ONES: u64 = 0x0101_0101_0101_0101;
const HIGHS: u64 = 0x8080_8080_8080_8080;

/// Whether any byte of the eight in `w` is a control character, `"` or a backslash (the classic
/// "has a byte less than n" and "has a zero byte" tricks: exact about whether, not where).
fn needs_escape(w: u64) -> bool {
    let control = w.wrapping_sub(ONES * 0x20) & !w;
    let q = w ^ (ONES * u64::from(b'"'));
    let quote = q.wrapping_sub(ONES) & !q;
    let b = w ^ (ONES * u64::from(b'\\'));
    let backslash = b.wrapping_sub(ONES) & !b;
    (control | quote | backslash) & HIGHS != 0
}

/// Appends `text` JSON-escaped exactly as serde_json escapes it: the two-character forms for
/// `"`, backslash, backspace, form feed, newline, carriage return and tab, `\u00xx` (lower-case hex)
/// for the other controls, everything else (DEL and non-ASCII included) as it is. Every byte
/// escaped is ASCII, so the pieces copied between them are whole characters.
pub(crate) fn escape_into(out: &mut String, text: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let bytes = text.as_bytes();
    let mut start = 0;
    let mut i = 0;
    while i < bytes.len() {
        if let Some(chunk) = bytes
            .get(i..i + 8)
            .and_then(|c| <[u8; 8]>::try_from(c).ok())
            && !needs_escape(u64::from_le_bytes(chunk))
        {
            i += 8;
            continue;
        }
        let b = bytes[i];
        let short = match b {
            b'"' => Some('"'),
            b'\\' => Some('\\'),
            0x08 => Some('b'),
            0x0c => Some('f'),
            b'\n' => Some('n'),
            b'\r' => Some('r'),
            b'\t' => Some('t'),
            0x00..=0x1f => None,
            _ => {
                i += 1;
                continue;
            }
        };
        out.push_str(&text[start..i]);
        out.push('\\');
        match short {
            Some(c) => out.push(c),
            None => {
                out.push_str("u00");
                out.push(char::from(HEX[usize::from(b >> 4)]));
                out.push(char::from(HEX[usize::from(b & 0xf)]));
            }
        }
        i += 1;
        start = i;
    }
    out.push_str(&text[start..]);
}

/// A JSON value kept as its text (a tool's schema, say): checked to be JSON when parsed, written
/// back byte for byte, never built into a tree of maps. Two are equal when their texts are.
/// Only serde_json reads it (its `from_slice`, `from_str` and `from_value`); it cannot sit inside
/// a `#[serde(flatten)]`, untagged or internally tagged type, which buffer their input.
#[derive(Clone)]
pub struct RawJson(Box<RawValue>);

impl RawJson {
    /// The JSON text.
    pub fn get(&self) -> &str {
        self.0.get()
    }

    /// `value` as raw JSON.
    pub fn from_value(value: &serde_json::Value) -> Self {
        // A `Value` always serializes.
        match serde_json::value::to_raw_value(value) {
            Ok(raw) => RawJson(raw),
            Err(_) => RawJson(RawValue::NULL.to_owned()),
        }
    }

    /// The text parsed into a [`serde_json::Value`] (for reading a field or two).
    pub fn to_value(&self) -> serde_json::Value {
        serde_json::from_str(self.get()).unwrap_or(serde_json::Value::Null)
    }
}

impl PartialEq for RawJson {
    fn eq(&self, other: &Self) -> bool {
        self.get() == other.get()
    }
}

impl fmt::Debug for RawJson {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.get())
    }
}

impl Serialize for RawJson {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for RawJson {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Box::<RawValue>::deserialize(deserializer).map(RawJson)
    }
}

/// Declares a zero-sized type that serializes as one fixed string and accepts only that string,
/// for `"type": "message"`-style fields the caller should not have to fill in.
macro_rules! const_tag {
    ($(#[$meta:meta])* $name:ident = $value:literal) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
        pub struct $name;

        impl ::serde::Serialize for $name {
            fn serialize<S: ::serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str($value)
            }
        }

        impl<'de> ::serde::Deserialize<'de> for $name {
            fn deserialize<D: ::serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct V;
                impl ::serde::de::Visitor<'_> for V {
                    type Value = $name;
                    fn expecting(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                        write!(f, "the string {:?}", $value)
                    }
                    fn visit_str<E: ::serde::de::Error>(self, v: &str) -> Result<$name, E> {
                        if v == $value {
                            Ok($name)
                        } else {
                            Err(E::invalid_value(::serde::de::Unexpected::Str(v), &self))
                        }
                    }
                }
                d.deserialize_str(V)
            }
        }
    };
}
pub(crate) use const_tag;

#[cfg(test)]
mod tests {
    use super::*;

    const_tag!(Demo = "demo");

    #[test]
    fn text_or_list_keeps_its_shape() {
        let t: TextOrList<u8> = serde_json::from_str(r#""hi""#).unwrap();
        assert_eq!(t, TextOrList::Text("hi".into()));
        assert_eq!(serde_json::to_string(&t).unwrap(), r#""hi""#);
        let l: TextOrList<u8> = serde_json::from_str("[1,2]").unwrap();
        assert_eq!(l, TextOrList::List(vec![1, 2]));
        assert_eq!(serde_json::to_string(&l).unwrap(), "[1,2]");
        assert!(serde_json::from_str::<TextOrList<u8>>("3").is_err());
    }

    /// `text` through serde_json's writer: the bytes serde_json itself writes for the string.
    fn written(s: &str) -> String {
        struct W<'a>(&'a str);
        impl Serialize for W<'_> {
            fn serialize<S: Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
                text(self.0, ser)
            }
        }
        let fast = serde_json::to_string(&W(s)).unwrap();
        assert_eq!(serde_json::to_value(W(s)).unwrap(), serde_json::json!(s));
        fast
    }

    #[test]
    fn long_text_is_escaped_exactly_as_serde_json_escapes_it() {
        let every_ascii: String = (0u8..=0x7f).map(char::from).collect();
        for s in [
            every_ascii.repeat(3),
            "é\u{2028}\"\\/\u{7f}".repeat(60),
            format!("{}\n", "x".repeat(300)),
            format!("\u{1}{}", "y".repeat(257)),
        ] {
            assert_eq!(written(&s), serde_json::to_string(&s).unwrap());
        }
    }

    proptest::proptest! {
        #[test]
        fn any_text_is_written_as_serde_json_writes_it(s in "(?s).{0,600}", pad in 0usize..300) {
            let s = format!("{}{s}", "a".repeat(pad));
            proptest::prop_assert_eq!(written(&s), serde_json::to_string(&s).unwrap());
        }
    }

    #[test]
    fn fast_value_is_written_as_serde_json_writes_it() {
        let long = format!("{}\n\"é\u{1}{}", "a".repeat(300), "\\".repeat(40));
        let v = serde_json::json!({
            "model": "m", "n": [1, 2.5, -3, null, true], "empty": {}, "list": [],
            "messages": [{"role": "user", "content": [{"type": "text", "text": long}]}],
            "long key": long.clone(),
        });
        let fast = serde_json::to_string(&FastValue(&v)).unwrap();
        assert_eq!(fast, serde_json::to_string(&v).unwrap());
        let pretty = serde_json::to_string_pretty(&FastValue(&v)).unwrap();
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&pretty).unwrap(),
            v
        );
        assert_eq!(serde_json::to_value(FastValue(&v)).unwrap(), v);
    }

    #[test]
    fn raw_json_is_kept_as_written() {
        let raw: RawJson = serde_json::from_str(r#"{ "b": 1, "a": [1.0, "\u00e9"] }"#).unwrap();
        assert_eq!(raw.get(), r#"{ "b": 1, "a": [1.0, "\u00e9"] }"#);
        assert_eq!(serde_json::to_string(&raw).unwrap(), raw.get());
        assert_eq!(raw.to_value(), serde_json::json!({"b": 1, "a": [1.0, "é"]}));
        let from_value: RawJson = serde_json::from_value(serde_json::json!({"x": null})).unwrap();
        assert_eq!(from_value.get(), r#"{"x":null}"#);
    }

    #[test]
    fn const_tag_accepts_only_its_value() {
        assert_eq!(serde_json::to_string(&Demo).unwrap(), r#""demo""#);
        assert!(serde_json::from_str::<Demo>(r#""demo""#).is_ok());
        assert!(serde_json::from_str::<Demo>(r#""other""#).is_err());
    }
}
