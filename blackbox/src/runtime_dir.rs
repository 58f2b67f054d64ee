//! The runtime root and each registration's runtime directory, made private.
//!
//! A runtime directory holds what guards the agent: the OpenClaw gateway token
//! (`openclaw.json`), Codex's `config.toml`, the agent's home and its logs (prompts and
//! answers). Every local user is an attacker, so the directory is created `0700` and the root
//! above it must be one no other user can swap or read through: every existing component of
//! its path is owned by root or by us, and one that others may write is sticky (as `/tmp`
//! is). A root someone else owns (squatted before we created it, e.g. at the default
//! `/tmp/blackbox_server`) is refused, never written into.

use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Why a runtime directory could not be made private.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeDirError {
    /// A component of the root's path is owned by another user.
    #[error(
        "{path} is owned by uid {owner}, not by root or this server (uid {us}): refusing to keep agent files under it"
    )]
    ForeignOwner { path: PathBuf, owner: u32, us: u32 },
    /// A component of the root's path is writable by others and not sticky.
    #[error(
        "{path} is writable by other users (mode {mode:o}) and not sticky: refusing to keep agent files under it"
    )]
    OpenForWriting { path: PathBuf, mode: u32 },
    /// The root is not a directory (a symlink included: it is never followed).
    #[error("{0} is not a directory")]
    NotADirectory(PathBuf),
    /// The file system refused.
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

/// Creates the runtime directory `dir` with mode `0700` (it must not exist yet) under its
/// parent, the runtime root: created `0700` where it is missing, checked with [`check`], and
/// closed to `0700` if it is ours but open.
///
/// # Errors
/// See [`RuntimeDirError`].
pub fn prepare(dir: &Path) -> Result<(), RuntimeDirError> {
    let io_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| RuntimeDirError::Io { path, source }
    };
    let root = dir
        .parent()
        .ok_or_else(|| RuntimeDirError::NotADirectory(dir.to_path_buf()))?;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(root)
        .map_err(io_err(root))?;
    let meta = check(root)?;
    // Ours: an older server (or an operator) may have left it readable; close it.
    if meta.mode() & 0o077 != 0 {
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o700))
            .map_err(io_err(root))?;
    }
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(dir)
        .map_err(io_err(dir))
}

/// Whether `root` is a runtime root no other user can swap or fill: a directory (not a
/// symlink) we own, under ancestors owned by root or us that others cannot write unless
/// sticky. Its metadata, for the caller's further checks.
///
/// # Errors
/// See [`RuntimeDirError`].
pub fn check(root: &Path) -> Result<std::fs::Metadata, RuntimeDirError> {
    let us = rustix::process::geteuid().as_raw();
    let meta = std::fs::symlink_metadata(root).map_err(|source| RuntimeDirError::Io {
        path: root.to_path_buf(),
        source,
    })?;
    if !meta.is_dir() {
        return Err(RuntimeDirError::NotADirectory(root.to_path_buf()));
    }
    if meta.uid() != us {
        return Err(RuntimeDirError::ForeignOwner {
            path: root.to_path_buf(),
            owner: meta.uid(),
            us,
        });
    }
    for ancestor in root.ancestors().skip(1) {
        check_ancestor(ancestor, us)?;
    }
    Ok(meta)
}

/// An ancestor may be owned by root or us; if others may write it, it must be sticky so
/// they cannot rename what lies below. Symlinked ancestors are judged by the link itself
/// and by what it points to.
fn check_ancestor(path: &Path, us: u32) -> Result<(), RuntimeDirError> {
    let io_err = |source| RuntimeDirError::Io {
        path: path.to_path_buf(),
        source,
    };
    let link = std::fs::symlink_metadata(path).map_err(io_err)?;
    let target = if link.file_type().is_symlink() {
        Some(std::fs::metadata(path).map_err(io_err)?)
    } else {
        None
    };
    for meta in std::iter::once(&link).chain(target.as_ref()) {
        if meta.uid() != 0 && meta.uid() != us {
            return Err(RuntimeDirError::ForeignOwner {
                path: path.to_path_buf(),
                owner: meta.uid(),
                us,
            });
        }
        let mode = meta.mode() & 0o7777;
        if !meta.file_type().is_symlink() && mode & 0o022 != 0 && mode & 0o1000 == 0 {
            return Err(RuntimeDirError::OpenForWriting {
                path: path.to_path_buf(),
                mode,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    const NOBODY: u32 = 65534;

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().mode() & 0o7777
    }

    #[test]
    fn a_missing_root_and_the_runtime_dir_are_created_private() {
        let t = tempfile::tempdir().unwrap();
        std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let root = t.path().join("a/root");
        let dir = root.join("rt-1");
        prepare(&dir).unwrap();
        assert_eq!(mode(&root), 0o700);
        assert_eq!(mode(&t.path().join("a")), 0o700);
        assert_eq!(mode(&dir), 0o700);
        // The name is never reused.
        assert!(matches!(prepare(&dir), Err(RuntimeDirError::Io { .. })));
    }

    #[test]
    fn an_open_root_of_ours_is_closed() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("root");
        std::fs::create_dir(&root).unwrap();
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).unwrap();
        prepare(&root.join("rt")).unwrap();
        assert_eq!(mode(&root), 0o700);
    }

    #[test]
    fn a_root_squatted_by_another_user_is_refused_and_left_untouched() {
        if !rustix::process::geteuid().is_root() {
            return; // chown to another uid needs root; CI runs as root.
        }
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("root");
        std::fs::create_dir(&root).unwrap();
        std::os::unix::fs::chown(&root, Some(NOBODY), Some(NOBODY)).unwrap();
        let err = prepare(&root.join("rt")).unwrap_err();
        assert!(
            matches!(err, RuntimeDirError::ForeignOwner { owner: NOBODY, .. }),
            "{err}"
        );
        assert!(!root.join("rt").exists());
    }

    #[test]
    fn a_root_under_a_directory_others_can_write_is_refused() {
        let t = tempfile::tempdir().unwrap();
        let open = t.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let err = prepare(&open.join("root/rt")).unwrap_err();
        assert!(
            matches!(err, RuntimeDirError::OpenForWriting { mode: 0o777, .. }),
            "{err}"
        );
        // Sticky (like /tmp) is fine: others cannot rename what we own inside it.
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
        prepare(&open.join("root/rt")).unwrap();
    }

    #[test]
    fn a_root_that_is_a_symlink_is_refused() {
        let t = tempfile::tempdir().unwrap();
        std::fs::create_dir(t.path().join("real")).unwrap();
        std::os::unix::fs::symlink(t.path().join("real"), t.path().join("link")).unwrap();
        let err = prepare(&t.path().join("link/rt")).unwrap_err();
        assert!(matches!(err, RuntimeDirError::NotADirectory(_)), "{err}");
    }
}
