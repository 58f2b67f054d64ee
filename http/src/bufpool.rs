//! Buffers for request bodies of 64 KiB to 1 MiB, kept for reuse once a body is done with.
//!
//! The gateway and the bridge tell glibc to map every block of 64 KiB or more on its own and to
//! unmap it when it is freed (`MallocTuning::PROXY`), so a burst's bodies do not stay behind as
//! heap fragmentation. The price was paid on every request: a ~100 KB body cost an `mmap`, one
//! page fault per 4 KiB page as it was filled, and a `munmap` whose TLB shootdown interrupts
//! every core the daemon's threads run on (BENCHMARKS.md, "Reused body buffers"). A buffer from
//! here is given back when the last `Bytes` sharing it drops, kept while the pool holds less
//! than [`POOL_BYTES`], and handed to the next body of its size class with its pages already
//! in place. What the pool keeps is bounded, so after a burst at most [`POOL_BYTES`] stay.

use std::sync::{Mutex, PoisonError};

use bytes::Bytes;

/// The smallest class: below it glibc serves blocks from its heaps anyway.
pub const MIN_CLASS: usize = 64 << 10;

/// The largest class; a larger body gets a buffer of its own, freed when done.
pub const MAX_CLASS: usize = 1 << 20;

/// The most bytes of capacity the pool keeps while no body uses them.
pub const POOL_BYTES: usize = 2 << 20;

/// Classes are the powers of two from [`MIN_CLASS`] to [`MAX_CLASS`].
const CLASSES: usize = (MAX_CLASS / MIN_CLASS).trailing_zeros() as usize + 1;

struct Pool {
    free: [Vec<Vec<u8>>; CLASSES],
    /// Capacity of everything in `free`.
    bytes: usize,
}

static POOL: Mutex<Pool> = Mutex::new(Pool {
    free: [const { Vec::new() }; CLASSES],
    bytes: 0,
});

fn pool() -> std::sync::MutexGuard<'static, Pool> {
    // The pool holds no invariant a panic could break halfway: a poisoned lock is still usable.
    POOL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The class index and capacity for a body of `len` bytes, if it is pooled.
fn class_of(len: usize) -> Option<(usize, usize)> {
    if len > MAX_CLASS {
        return None;
    }
    let cap = len.max(MIN_CLASS).next_power_of_two();
    Some(((cap / MIN_CLASS).trailing_zeros() as usize, cap))
}

/// A body buffer: from the pool when its size is in a class, a plain vector otherwise.
#[derive(Debug)]
pub struct BodyBuf {
    vec: Vec<u8>,
    /// The class it goes back to, while its capacity is still that class's.
    class: Option<usize>,
}

impl BodyBuf {
    /// An empty buffer that holds at least `len` bytes without growing. A size in a class gets
    /// that class's capacity (at most twice `len`, see [`BodyBuf::capacity`]).
    pub fn with_capacity(len: usize) -> BodyBuf {
        let Some((class, cap)) = class_of(len) else {
            return BodyBuf {
                vec: Vec::with_capacity(len),
                class: None,
            };
        };
        let reused = {
            let mut pool = pool();
            let found = pool.free[class].pop();
            if let Some(v) = &found {
                pool.bytes -= v.capacity();
            }
            found
        };
        BodyBuf {
            vec: reused.unwrap_or_else(|| Vec::with_capacity(cap)),
            class: Some(class),
        }
    }

    /// The capacity [`BodyBuf::with_capacity`] gives for `len` bytes, known before anything is
    /// allocated (so a budget can be charged first).
    pub fn capacity_for(len: usize) -> usize {
        class_of(len).map_or(len, |(_, cap)| cap)
    }

    /// A buffer that is never pooled (a body of unknown length starts here and grows).
    pub fn new() -> BodyBuf {
        BodyBuf {
            vec: Vec::new(),
            class: None,
        }
    }

    /// The bytes it holds.
    pub fn len(&self) -> usize {
        self.vec.len()
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.vec.is_empty()
    }

    /// The bytes it can hold without growing: what a budget must be charged for.
    pub fn capacity(&self) -> usize {
        self.vec.capacity()
    }

    /// Makes room for `additional` more bytes. A pooled buffer that has to grow leaves its
    /// class and is freed, not pooled, when done.
    pub fn reserve_exact(&mut self, additional: usize) {
        self.vec.reserve_exact(additional);
    }

    /// The vector itself, for a writer that appends to one. Past its capacity it grows out of
    /// its class, and is then freed, not pooled, when done.
    pub fn vec_mut(&mut self) -> &mut Vec<u8> {
        &mut self.vec
    }

    /// Appends `bytes`.
    pub fn extend_from_slice(&mut self, bytes: &[u8]) {
        self.vec.extend_from_slice(bytes);
    }

    /// The bytes, shared: the buffer goes back to the pool when the last clone or slice drops.
    pub fn freeze(self) -> Bytes {
        match self.class {
            Some(_) => Bytes::from_owner(self),
            None => {
                let mut plain = self;
                Bytes::from(std::mem::take(&mut plain.vec))
            }
        }
    }
}

impl Default for BodyBuf {
    fn default() -> Self {
        BodyBuf::new()
    }
}

impl AsRef<[u8]> for BodyBuf {
    fn as_ref(&self) -> &[u8] {
        &self.vec
    }
}

impl Drop for BodyBuf {
    fn drop(&mut self) {
        let Some(class) = self.class else { return };
        let cap = self.vec.capacity();
        if cap != MIN_CLASS << class {
            return;
        }
        let mut vec = std::mem::take(&mut self.vec);
        vec.clear();
        let mut pool = pool();
        if pool.bytes + cap <= POOL_BYTES {
            pool.bytes += cap;
            pool.free[class].push(vec);
        }
        // Otherwise `vec` is freed here, after the lock (dropped last, declared first).
    }
}

/// Capacity the pool keeps now, bytes (for tests and benches).
pub fn pooled_bytes() -> usize {
    pool().bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    // One test owns the process-wide pool, so the counts below are not raced by another.
    #[test]
    fn buffers_come_back_once_the_last_share_drops_and_the_pool_stays_bounded() {
        assert_eq!(class_of(1), Some((0, MIN_CLASS)));
        assert_eq!(class_of(MIN_CLASS), Some((0, MIN_CLASS)));
        assert_eq!(class_of(MIN_CLASS + 1), Some((1, 2 * MIN_CLASS)));
        assert_eq!(class_of(MAX_CLASS), Some((CLASSES - 1, MAX_CLASS)));
        assert_eq!(class_of(MAX_CLASS + 1), None);

        let before = pooled_bytes();
        let mut a = BodyBuf::with_capacity(100_000);
        assert_eq!(a.capacity(), 128 << 10);
        assert_eq!(BodyBuf::capacity_for(100_000), 128 << 10);
        assert_eq!(BodyBuf::capacity_for(MAX_CLASS + 1), MAX_CLASS + 1);
        a.extend_from_slice(&[7; 100_000]);
        let ptr = a.as_ref().as_ptr();
        let bytes = a.freeze();
        let slice = bytes.slice(10..20);
        drop(bytes);
        assert_eq!(pooled_bytes(), before, "a slice still shares the buffer");
        assert_eq!(&slice[..], &[7; 10]);
        drop(slice);
        assert_eq!(pooled_bytes(), before + (128 << 10));

        // The next body of that class gets the same memory, empty.
        let b = BodyBuf::with_capacity(70_000);
        assert_eq!(b.as_ref().as_ptr(), ptr);
        assert!(b.is_empty());
        assert_eq!(pooled_bytes(), before);
        drop(b);

        // A buffer that outgrew its class is not kept.
        let mut grown = BodyBuf::with_capacity(MIN_CLASS);
        grown.extend_from_slice(&vec![1; MIN_CLASS + 1]);
        let kept = pooled_bytes();
        drop(grown.freeze());
        assert_eq!(pooled_bytes(), kept);

        // Larger bodies and unknown lengths are never pooled.
        drop(BodyBuf::with_capacity(MAX_CLASS + 1).freeze());
        drop(BodyBuf::new().freeze());
        assert_eq!(pooled_bytes(), kept);

        // However many come back at once, the pool keeps at most POOL_BYTES.
        let many: Vec<_> = (0..64).map(|_| BodyBuf::with_capacity(MAX_CLASS)).collect();
        drop(many);
        assert!(pooled_bytes() <= POOL_BYTES, "{}", pooled_bytes());
        assert!(pooled_bytes() >= POOL_BYTES - MAX_CLASS);
    }
}
