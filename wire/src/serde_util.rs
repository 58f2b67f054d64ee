//! Serde building blocks shared by the wire types: the "string or list" shape every LLM API
//! uses for content, and fixed `type` tags that need no value from the caller.
//!
//! Both are hand-written instead of `#[serde(untagged)]` because untagged enums buffer the whole
//! value before trying each variant, and message content is where a 100 KB request spends its
//! bytes.

use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::ser::Serializer;
use serde::{Deserialize, Serialize};

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
            TextOrList::Text(s) => serializer.serialize_str(s),
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

    #[test]
    fn const_tag_accepts_only_its_value() {
        assert_eq!(serde_json::to_string(&Demo).unwrap(), r#""demo""#);
        assert!(serde_json::from_str::<Demo>(r#""demo""#).is_ok());
        assert!(serde_json::from_str::<Demo>(r#""other""#).is_err());
    }
}
