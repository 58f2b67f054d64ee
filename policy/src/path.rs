//! Request paths (repository paths, venvs) checked as strings before anything touches the
//! filesystem: absolute, already normalized, bounded, and inside a configured root when
//! compared component by component.
//!
//! Nothing here is "fixed up": a path with `.`, `..`, `//` or a trailing `/` is refused, not
//! normalized, because silently normalizing is how `/srv/repos/../etc` ends up accepted and
//! because the caller should send the same string it will see in logs. The string checks only
//! say the *name* is acceptable; opening it without following symlinks is [`crate::resolve`]'s
//! job, which takes the [`RelPath`] this module produces.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::id::shown;
use crate::newtype::validated_string;

/// Linux `PATH_MAX`, which counts the terminating NUL: a path may be at most 4095 bytes.
pub const PATH_MAX: usize = 4096;
/// Linux `NAME_MAX`: the longest single component, in bytes.
pub const NAME_MAX: usize = 255;

/// A refused path, with the (escaped, shortened) input and the rule it broke.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("path {shown} refused: {reason}")]
pub struct PathError {
    pub shown: String,
    pub reason: PathReason,
}

/// The rule a path broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathReason {
    Empty,
    TooLong {
        len: usize,
    },
    Nul,
    /// Control characters (newline, tab, escape, C1 controls...) have no business in a repository path
    /// and would let a path forge log lines or git config entries.
    ControlChar,
    NotAbsolute,
    /// A [`RelPath`] was given a leading `/`.
    Absolute,
    TrailingSlash,
    /// `//` somewhere in the path.
    EmptyComponent,
    DotComponent,
    DotDotComponent,
    ComponentTooLong {
        len: usize,
    },
    /// A single file name was expected but the input contains `/`.
    NotAComponent,
    /// `/` configured as a root would allow every path on the host.
    FilesystemRoot,
    NotInRoots,
    /// The path names a root itself and the caller did not allow that.
    IsRoot,
}

impl fmt::Display for PathReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PathReason::Empty => f.write_str("empty path"),
            PathReason::TooLong { len } => {
                write!(f, "{len} bytes long, at most {} allowed", PATH_MAX - 1)
            }
            PathReason::Nul => f.write_str("contains a NUL byte"),
            PathReason::ControlChar => f.write_str("contains a control character"),
            PathReason::NotAbsolute => f.write_str("not absolute"),
            PathReason::Absolute => f.write_str("must be relative"),
            PathReason::TrailingSlash => f.write_str("has a trailing slash"),
            PathReason::EmptyComponent => f.write_str("has an empty component (//)"),
            PathReason::DotComponent => f.write_str("has a . component"),
            PathReason::DotDotComponent => f.write_str("has a .. component"),
            PathReason::ComponentTooLong { len } => {
                write!(f, "has a {len}-byte component, at most {NAME_MAX} allowed")
            }
            PathReason::NotAComponent => f.write_str("contains / where one file name is expected"),
            PathReason::FilesystemRoot => f.write_str("/ cannot be a root"),
            PathReason::NotInRoots => f.write_str("not inside any allowed root"),
            PathReason::IsRoot => f.write_str("names an allowed root itself, not a path inside it"),
        }
    }
}

fn refuse(input: &str, reason: PathReason) -> PathError {
    PathError {
        shown: shown(input),
        reason,
    }
}

/// Checks what absolute and relative paths share: bounds, bytes, and each component.
/// `body` is the part after the leading `/` for absolute paths.
fn check_common(input: &str, body: &str) -> Result<(), PathError> {
    if input.len() >= PATH_MAX {
        return Err(refuse(input, PathReason::TooLong { len: input.len() }));
    }
    if input.contains('\0') {
        return Err(refuse(input, PathReason::Nul));
    }
    if input.chars().any(char::is_control) {
        return Err(refuse(input, PathReason::ControlChar));
    }
    if body.is_empty() {
        return Ok(());
    }
    if body.ends_with('/') {
        return Err(refuse(input, PathReason::TrailingSlash));
    }
    for component in body.split('/') {
        check_component(component).map_err(|reason| refuse(input, reason))?;
    }
    Ok(())
}

fn check_component(component: &str) -> Result<(), PathReason> {
    match component {
        "" => Err(PathReason::EmptyComponent),
        "." => Err(PathReason::DotComponent),
        ".." => Err(PathReason::DotDotComponent),
        c if c.len() > NAME_MAX => Err(PathReason::ComponentTooLong { len: c.len() }),
        _ => Ok(()),
    }
}

/// Validates one path component (a file name): non-empty, not `.` or `..`, no `/`, NUL or
/// control character, at most [`NAME_MAX`] bytes.
pub fn validate_component(component: &str) -> Result<(), PathError> {
    if component.contains('\0') {
        return Err(refuse(component, PathReason::Nul));
    }
    if component.chars().any(char::is_control) {
        return Err(refuse(component, PathReason::ControlChar));
    }
    if component.contains('/') {
        return Err(refuse(component, PathReason::NotAComponent));
    }
    check_component(component).map_err(|reason| refuse(component, reason))
}

fn check_absolute(input: &str) -> Result<(), PathError> {
    if input.is_empty() {
        return Err(refuse(input, PathReason::Empty));
    }
    let Some(body) = input.strip_prefix('/') else {
        // Bounds first so a huge relative path reports its size, not just "not absolute".
        check_common(input, "")?;
        return Err(refuse(input, PathReason::NotAbsolute));
    };
    check_common(input, body)
}

/// A configured root (repo root, venv root): absolute, normalized, not `/` itself.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct RootPath(String);

/// Validates a configured root; config loading calls this for every root it reads.
pub fn validate_root(input: &str) -> Result<RootPath, PathError> {
    check_absolute(input)?;
    if input == "/" {
        return Err(refuse(input, PathReason::FilesystemRoot));
    }
    Ok(RootPath(input.to_owned()))
}

validated_string!(RootPath, PathError, validate_root; display, path);

/// Whether a request may name a root itself rather than something strictly inside it.
///
/// Roots are directories *of* things (repositories, venvs), so the conservative default for
/// every caller is [`EqualsRoot::Refuse`]: `/srv/repos` is not a repository. `Allow` exists for
/// the rare caller that really wants the root directory itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EqualsRoot {
    #[default]
    Refuse,
    Allow,
}

/// An absolute, normalized path as received in a request, not yet tied to a root.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct RequestPath(String);

/// Where a request path landed: the root that contains it and the components below that root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Within<'r> {
    pub root: &'r RootPath,
    pub rel: RelPath,
}

impl RequestPath {
    /// Absolute, at most 4095 bytes, no NUL or control character, no `.`, `..` or empty
    /// component, no trailing `/`, each component at most 255 bytes.
    pub fn parse(input: &str) -> Result<RequestPath, PathError> {
        check_absolute(input)?;
        Ok(RequestPath(input.to_owned()))
    }

    /// Finds the root this path lies in, comparing whole components (`/srv/repos2` is not inside
    /// `/srv/repos`). When roots nest, the longest (most specific) one wins, so the answer does
    /// not depend on the order of the configuration.
    pub fn within<'r>(
        &self,
        roots: &'r [RootPath],
        equals_root: EqualsRoot,
    ) -> Result<Within<'r>, PathError> {
        let mut best: Option<(&'r RootPath, Vec<&str>)> = None;
        let mut was_root = false;
        for root in roots {
            let mut mine = self.components();
            let mut inside = true;
            for want in root.components() {
                if mine.next() != Some(want) {
                    inside = false;
                    break;
                }
            }
            if !inside {
                continue;
            }
            let rest: Vec<&str> = mine.collect();
            if rest.is_empty() && equals_root == EqualsRoot::Refuse {
                was_root = true;
                continue;
            }
            let longer = best
                .as_ref()
                .is_none_or(|(b, _)| root.components().count() > b.components().count());
            if longer {
                best = Some((root, rest));
            }
        }
        match best {
            Some((root, rest)) => Ok(Within {
                root,
                rel: RelPath(rest.join("/")),
            }),
            None if was_root => Err(refuse(&self.0, PathReason::IsRoot)),
            None => Err(refuse(&self.0, PathReason::NotInRoots)),
        }
    }
}

validated_string!(RequestPath, PathError, RequestPath::parse; display, path);

/// A relative path of plain components below some root: what [`crate::resolve`] walks.
/// The empty `RelPath` names the root itself.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct RelPath(String);

impl RelPath {
    /// The root itself.
    pub fn empty() -> RelPath {
        RelPath(String::new())
    }

    /// Parses `a/b/c`; `""` is the root itself. Same rules as [`RequestPath`] minus the leading
    /// `/`, which is refused.
    pub fn parse(input: &str) -> Result<RelPath, PathError> {
        if input.starts_with('/') {
            return Err(refuse(input, PathReason::Absolute));
        }
        check_common(input, input)?;
        Ok(RelPath(input.to_owned()))
    }

    /// Appends one component (e.g. a [`crate::id::Tid`]), validated like any other.
    pub fn join(&self, component: &str) -> Result<RelPath, PathError> {
        validate_component(component)?;
        let joined = if self.0.is_empty() {
            component.to_owned()
        } else {
            format!("{}/{component}", self.0)
        };
        if joined.len() >= PATH_MAX {
            return Err(refuse(&joined, PathReason::TooLong { len: joined.len() }));
        }
        Ok(RelPath(joined))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn components(&self) -> impl Iterator<Item = &str> {
        self.0.split('/').filter(|c| !c.is_empty())
    }
}

impl fmt::Display for RelPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            f.write_str(".")
        } else {
            f.write_str(&self.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::path::{Component, Path};

    fn roots() -> Vec<RootPath> {
        vec![validate_root("/srv/repos").unwrap()]
    }

    fn reason(input: &str) -> PathReason {
        RequestPath::parse(input).unwrap_err().reason
    }

    #[test]
    fn inside_by_components() {
        let roots = roots();
        let p = RequestPath::parse("/srv/repos/proj").unwrap();
        let w = p.within(&roots, EqualsRoot::Refuse).unwrap();
        assert_eq!(w.root.as_str(), "/srv/repos");
        assert_eq!(w.rel.as_str(), "proj");
        let p = RequestPath::parse("/srv/repos2").unwrap();
        assert_eq!(
            p.within(&roots, EqualsRoot::Allow).unwrap_err().reason,
            PathReason::NotInRoots
        );
        let p = RequestPath::parse("/srv/repos2/x").unwrap();
        assert!(p.within(&roots, EqualsRoot::Allow).is_err());
        let p = RequestPath::parse("/srv").unwrap();
        assert!(p.within(&roots, EqualsRoot::Allow).is_err());
    }

    #[test]
    fn root_itself_only_when_allowed() {
        let roots = roots();
        let p = RequestPath::parse("/srv/repos").unwrap();
        assert_eq!(
            p.within(&roots, EqualsRoot::Refuse).unwrap_err().reason,
            PathReason::IsRoot
        );
        let w = p.within(&roots, EqualsRoot::Allow).unwrap();
        assert!(w.rel.is_empty());
    }

    #[test]
    fn nested_roots_pick_longest() {
        let roots = vec![
            validate_root("/srv").unwrap(),
            validate_root("/srv/repos").unwrap(),
        ];
        let p = RequestPath::parse("/srv/repos/a/b").unwrap();
        let w = p.within(&roots, EqualsRoot::Refuse).unwrap();
        assert_eq!(w.root.as_str(), "/srv/repos");
        assert_eq!(w.rel.as_str(), "a/b");
        // Naming the inner root itself falls back to the outer one, where it is a child.
        let p = RequestPath::parse("/srv/repos").unwrap();
        let w = p.within(&roots, EqualsRoot::Refuse).unwrap();
        assert_eq!(w.root.as_str(), "/srv");
        assert_eq!(w.rel.as_str(), "repos");
    }

    #[test]
    fn refusals() {
        assert_eq!(reason(""), PathReason::Empty);
        assert_eq!(reason("srv/repos"), PathReason::NotAbsolute);
        assert_eq!(reason("/srv/repos/"), PathReason::TrailingSlash);
        assert_eq!(reason("/srv//repos"), PathReason::EmptyComponent);
        assert_eq!(reason("/srv/./repos"), PathReason::DotComponent);
        assert_eq!(reason("/srv/repos/.."), PathReason::DotDotComponent);
        assert_eq!(reason("/srv/re\0pos"), PathReason::Nul);
        assert_eq!(reason("/srv/re\npos"), PathReason::ControlChar);
        assert_eq!(
            reason(&format!("/{}", "a".repeat(256))),
            PathReason::ComponentTooLong { len: 256 }
        );
        let long = "/a".repeat(2048);
        assert_eq!(reason(&long), PathReason::TooLong { len: 4096 });
        assert!(RequestPath::parse(&"/a".repeat(2047)).is_ok());
        assert!(RequestPath::parse(&format!("/{}", "a".repeat(255))).is_ok());
        assert!(RequestPath::parse("/").is_ok());
    }

    #[test]
    fn roots_validated() {
        assert_eq!(
            validate_root("/").unwrap_err().reason,
            PathReason::FilesystemRoot
        );
        assert!(validate_root("/srv/repos/").is_err());
        assert!(validate_root("srv").is_err());
        assert!(serde_json::from_str::<RootPath>("\"/a/../b\"").is_err());
        let r: RootPath = serde_json::from_str("\"/srv/repos\"").unwrap();
        assert_eq!(serde_json::to_string(&r).unwrap(), "\"/srv/repos\"");
    }

    #[test]
    fn rel_paths() {
        assert!(RelPath::parse("").unwrap().is_empty());
        assert_eq!(RelPath::parse("a/b").unwrap().components().count(), 2);
        for bad in ["/a", "a/", "a//b", "./a", "a/..", "a\0", ".."] {
            assert!(RelPath::parse(bad).is_err(), "{bad:?}");
        }
        let r = RelPath::empty().join("tasks").unwrap().join("t1").unwrap();
        assert_eq!(r.as_str(), "tasks/t1");
        for bad in ["", ".", "..", "a/b", "a\0", "\n"] {
            assert!(r.join(bad).is_err(), "{bad:?}");
        }
    }

    /// An independent reading of the rules through `std::path`, which normalizes silently: a
    /// path is acceptable exactly when `std` sees only a root and plain components and
    /// re-joining them gives back the same string.
    fn reference_ok(s: &str) -> bool {
        if s.is_empty() || s.len() >= PATH_MAX || s.chars().any(char::is_control) {
            return false;
        }
        let mut rebuilt = String::new();
        let mut first = true;
        for c in Path::new(s).components() {
            match c {
                Component::RootDir if first => {}
                Component::Normal(n) => {
                    let n = n.to_str().unwrap_or("");
                    if n.len() > NAME_MAX {
                        return false;
                    }
                    rebuilt.push('/');
                    rebuilt.push_str(n);
                }
                Component::RootDir
                | Component::CurDir
                | Component::ParentDir
                | Component::Prefix(_) => return false,
            }
            first = false;
        }
        if first {
            return false;
        }
        if rebuilt.is_empty() {
            rebuilt.push('/');
        }
        rebuilt == s
    }

    fn reference_within(s: &str, root: &str) -> Option<String> {
        let p = Path::new(s);
        let rel = p.strip_prefix(root).ok()?;
        let rel = rel.to_str()?;
        if rel.is_empty() {
            None
        } else {
            Some(rel.to_owned())
        }
    }

    proptest! {
        #[test]
        fn agrees_with_reference(s in "(/|//|/\\./|/\\.\\./|a|b|\\.|\\.\\.|é|\n|\0|\u{85}){0,12}") {
            prop_assert_eq!(RequestPath::parse(&s).is_ok(), reference_ok(&s), "{:?}", s);
        }

        #[test]
        fn within_agrees_with_strip_prefix(
            s in "(/(srv|repos|repos2|a|x)){1,5}",
            root in "(/(srv|repos|a)){1,3}",
        ) {
            let roots = vec![validate_root(&root).unwrap()];
            let req = RequestPath::parse(&s).unwrap();
            let ours = req.within(&roots, EqualsRoot::Refuse).ok().map(|w| w.rel.as_str().to_owned());
            prop_assert_eq!(ours, reference_within(&s, &root));
        }

        #[test]
        fn normalized_paths_round_trip(parts in proptest::collection::vec("[a-zA-Z0-9_.-]{1,20}", 0..10)) {
            let s = format!("/{}", parts.join("/"));
            let ok = parts.iter().all(|p| p != "." && p != "..");
            prop_assert_eq!(RequestPath::parse(&s).is_ok(), ok);
            if ok {
                prop_assert_eq!(RequestPath::parse(&s).unwrap().components().count(), parts.len());
            }
        }
    }
}
