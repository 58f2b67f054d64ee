//! The conversions every validated string type of this crate shares ([`crate::id::Tid`],
//! [`crate::id::AgentBranch`], [`crate::path::RootPath`], [`crate::path::RequestPath`]), written
//! once so that every way into such a type goes through its one validating constructor.

/// Implements, for a newtype over `String` whose only constructor is `$parse`: `TryFrom<String>`
/// and `FromStr` through `$parse` (so serde's `try_from = "String"` and `str::parse` refuse
/// exactly what `$parse` refuses), and `From<$ty> for String` through `Display`. After `;`,
/// `display` adds a `Display` that writes `as_str()`; `path` adds, for an absolute path held as
/// a `String`, `as_str`, `as_path`, `components`, `AsRef<Path>` and `From<$ty> for PathBuf`.
macro_rules! validated_string {
    ($ty:ident, $err:ty, $parse:expr $(; $($extra:ident),+)?) => {
        impl TryFrom<String> for $ty {
            type Error = $err;
            fn try_from(value: String) -> Result<Self, Self::Error> {
                $parse(&value)
            }
        }

        impl std::str::FromStr for $ty {
            type Err = $err;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                $parse(s)
            }
        }

        impl From<$ty> for String {
            fn from(value: $ty) -> Self {
                value.to_string()
            }
        }

        $($($crate::newtype::validated_string!(@$extra $ty);)+)?
    };
    (@display $ty:ident) => {
        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
    (@path $ty:ident) => {
        impl $ty {
            pub fn as_str(&self) -> &str {
                &self.0
            }

            pub fn as_path(&self) -> &std::path::Path {
                std::path::Path::new(&self.0)
            }

            /// The components after the leading `/`.
            pub fn components(&self) -> impl Iterator<Item = &str> {
                self.0.split('/').filter(|c| !c.is_empty())
            }
        }

        impl AsRef<std::path::Path> for $ty {
            fn as_ref(&self) -> &std::path::Path {
                std::path::Path::new(self.as_str())
            }
        }

        impl From<$ty> for std::path::PathBuf {
            fn from(value: $ty) -> Self {
                std::path::PathBuf::from(String::from(value))
            }
        }
    };
}
pub(crate) use validated_string;
