//! A persistent pool of spinning worker threads for the kernels' fork-joins.
//!
//! A SmolLM2 decoding step is about 200 matrix products of 10-100 µs each. Handing one to rayon from
//! outside its pool and waking the caller again costs 6-10 µs (a futex wake-up each way), so small
//! products used to stay on one core, and a one-row step ran mostly single-threaded. Here the workers
//! spin on a shared counter for a while after each job (as ggml's threads do), then yield their core
//! between checks, so a hand-off costs about a microsecond while jobs come in quick succession, and they
//! park on a condition variable once the caller has gone quiet (between turns of a conversation, say), so
//! an idle process does not burn a core.
//!
//! The caller takes part in its own job, and never waits for a parked worker to wake up: a job is a
//! range of task indices that whoever is there claims, so a late worker finds nothing left to do. The
//! caller claims from the front and the workers from the back, so a worker knows which part of the next
//! job it will most likely run, and may fetch that part's weights while it waits for the caller to
//! finish the step's serial work ([`Pool::prefetch_hint`]); the memory idles then otherwise. A matrix
//! product's job ([`Pool::run_ranges`]) is claimed in ranges that shrink as the two ends meet, so
//! that a thread slowed for a while (the host's other tenants share its core and memory) leaves the
//! other little to wait for at the end.
//! Results never depend on which thread ran a task (each task writes its own outputs with its own fixed
//! arithmetic), so a job submitted while another is running (tests in parallel, a nested call) simply
//! runs on its caller's thread.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long an idle worker keeps spinning before it parks. Long enough to span the gaps between the
/// products of a step and between steps (sampling, tree building), short enough not to matter when the
/// process waits for input.
const SPIN: Duration = Duration::from_millis(2);

/// Busy-wait iterations (a few microseconds) before a waiting thread starts yielding its core between
/// checks.
const YIELD_AFTER: u32 = 2048;

/// The job being run: a borrowed closure over ranges of task indices (lifetime erased; see
/// `Pool::run_in` for why that is sound), and how large a range each claim takes (see [`claim`]).
/// Its tasks are counted in `Shared::claims`.
#[derive(Clone, Copy)]
struct Job {
    f: *const (dyn Fn(usize, usize) + Sync),
    sizes: Chunks,
}

/// How many task indices one claim takes: `max(min, left / div)` (`div` 0: always `min`), at most
/// what is left.
#[derive(Clone, Copy)]
struct Chunks {
    min: usize,
    div: usize,
}

impl Chunks {
    const ONE: Chunks = Chunks { min: 1, div: 0 };

    fn size(self, left: usize) -> usize {
        let guided = left.checked_div(self.div).unwrap_or(0);
        guided.max(self.min).min(left)
    }
}

struct Shared {
    /// Bumped for every job, so a worker knows there is something new to look at.
    epoch: AtomicU64,
    /// Whether `job` may be read: set after it is written, cleared before the caller waits for the
    /// workers to leave.
    open: AtomicBool,
    job: UnsafeCell<Job>,
    /// Task indices left to claim, `front | back << 32`: the caller takes them from the front, the
    /// workers from the back, so a worker's share is the end of a job (what it prefetched, see
    /// `hint_ptr`).
    claims: AtomicU64,
    /// Bytes a worker may bring into its caches while it waits: `hint_seq` bumped after `hint_ptr` and
    /// `hint_len` are written. Read without a lock: a torn pair only names other addresses, and a
    /// prefetch of any address is harmless.
    hint_ptr: AtomicUsize,
    hint_len: AtomicUsize,
    hint_seq: AtomicU64,
    /// Workers inside the current job.
    active: AtomicUsize,
    /// Parked workers, and how they are woken.
    sleeping: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by the one caller holding `Pool::submit`, while `open` is false and no
// worker is inside a job (`active == 0`); workers read it only between raising `active` and seeing
// `open` set, both sequentially consistent (see `Pool::run_in`).
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

pub struct Pool {
    shared: Arc<Shared>,
    /// Threads a job runs on, the caller included.
    threads: usize,
    /// One job at a time; a second caller runs its job alone.
    submit: Mutex<()>,
}

impl Pool {
    /// The process's pool: `RAYON_NUM_THREADS` threads if set (the variable candle and rayon read), else
    /// one per core, the caller being one of them.
    pub fn global() -> &'static Pool {
        static POOL: OnceLock<Pool> = OnceLock::new();
        POOL.get_or_init(|| {
            let threads = std::env::var("RAYON_NUM_THREADS")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .filter(|&n| n > 0)
                .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
                .unwrap_or(1);
            Pool::new(threads)
        })
    }

    fn new(threads: usize) -> Pool {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            open: AtomicBool::new(false),
            job: UnsafeCell::new(Job {
                f: &|_, _| {},
                sizes: Chunks::ONE,
            }),
            claims: AtomicU64::new(0),
            hint_ptr: AtomicUsize::new(0),
            hint_len: AtomicUsize::new(0),
            hint_seq: AtomicU64::new(0),
            active: AtomicUsize::new(0),
            sleeping: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        for i in 1..threads {
            let s = shared.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("probespec-kernel-{i}"))
                .spawn(move || worker(&s));
            if spawned.is_err() {
                // Fewer threads only means less parallelism.
                return Pool {
                    shared,
                    threads: i,
                    submit: Mutex::new(()),
                };
            }
        }
        Pool {
            shared,
            threads,
            submit: Mutex::new(()),
        }
    }

    /// Threads a job may run on (the caller included).
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Asks the idle workers to bring `bytes` into their caches while the caller works alone (a
    /// layer's norms, rope, residuals): the end of the next job's data, which lies in the range a
    /// worker claims first, since workers claim from the back. Only a hint: a worker follows it while
    /// it waits and drops it when a job comes.
    pub fn prefetch_hint(&self, bytes: &[u8]) {
        if self.threads < 2 {
            return;
        }
        let s = &*self.shared;
        s.hint_ptr.store(bytes.as_ptr() as usize, SeqCst);
        s.hint_len.store(bytes.len(), SeqCst);
        s.hint_seq.fetch_add(1, SeqCst);
    }

    /// Runs `f(0) .. f(tasks - 1)`, each exactly once, spread over the pool's threads and the caller;
    /// returns when all have finished. Inside a rayon pool of one thread (the kernels' tests pin their
    /// thread count that way) or while another job runs, everything runs on the caller's thread.
    pub fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        self.run_in(tasks, Chunks::ONE, &|a, b| (a..b).for_each(f));
    }

    /// Runs `f(a, b)` over ranges `a..b` that together cover `0..units` once each, spread as [`Pool::run`]
    /// spreads tasks. Each claim takes a share of what is left (`left / (2 · threads)`, at least `min`),
    /// so the ranges start large and shrink as the threads meet: a thread that ran slower for a while
    /// (another process on its core) leaves the other at most a small range to wait for at the end,
    /// where equal tasks left it up to a whole one (a matrix product's eighth). On one thread, or with
    /// at most `min` units, one range `0..units`. The cut depends on timing, so `f` must compute the
    /// same results however `0..units` is cut (a product's groups do:
    /// `q8::tests::any_cut_into_ranges_gives_the_same_bits`).
    pub fn run_ranges(&self, units: usize, min: usize, f: &(dyn Fn(usize, usize) + Sync)) {
        let sizes = Chunks {
            min: min.max(1),
            div: 2 * self.threads,
        };
        self.run_in(units, sizes, f);
    }

    fn run_in(&self, tasks: usize, sizes: Chunks, f: &(dyn Fn(usize, usize) + Sync)) {
        // (`claims` counts tasks in 32 bits.)
        let fits = u32::try_from(tasks).is_ok();
        let guard = if fits && tasks > sizes.min && self.threads > 1 && rayon::current_num_threads() > 1 {
            self.submit.try_lock().ok()
        } else {
            None
        };
        let Some(_guard) = guard else {
            if tasks > 0 {
                f(0, tasks);
            }
            return;
        };
        let s = &*self.shared;
        // SAFETY: we hold `submit`, and the previous job ended with `open` false and `active` 0, so no
        // worker reads `job` now. The lifetime is erased, but `f` outlives every use: a worker reads the
        // job only after raising `active` and then seeing `open`; we clear `open` and then wait for
        // `active` to reach 0 before returning. In the sequentially consistent order, a worker that raises
        // `active` after our last read of it also reads `open` after we cleared it, and leaves.
        unsafe {
            *s.job.get() = Job {
                f: std::mem::transmute::<
                    *const (dyn Fn(usize, usize) + Sync + '_),
                    *const (dyn Fn(usize, usize) + Sync),
                >(f),
                sizes,
            };
        }
        s.claims.store((tasks as u64) << 32, SeqCst);
        s.open.store(true, SeqCst);
        s.epoch.fetch_add(1, SeqCst);
        if s.sleeping.load(SeqCst) > 0 {
            let _l = s.lock.lock().unwrap();
            s.wake.notify_all();
        }
        while let Some((a, b)) = claim(&s.claims, true, sizes) {
            f(a, b);
        }
        s.open.store(false, SeqCst);
        let mut spins = 0u32;
        while s.active.load(SeqCst) != 0 {
            // A worker still inside may have been preempted (a busy machine): let it run.
            spins += 1;
            if spins > YIELD_AFTER {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

/// A mutable slice that the tasks of one job write in disjoint ranges.
pub struct SharedMut<'a, T> {
    ptr: *mut T,
    len: usize,
    _slice: std::marker::PhantomData<&'a mut [T]>,
}

// SAFETY: tasks only take disjoint ranges (the caller of `range` promises it).
unsafe impl<T: Send> Sync for SharedMut<'_, T> {}

impl<'a, T> SharedMut<'a, T> {
    pub fn new(s: &'a mut [T]) -> Self {
        SharedMut {
            ptr: s.as_mut_ptr(),
            len: s.len(),
            _slice: std::marker::PhantomData,
        }
    }

    /// Elements `start .. start + len` (clipped to the end).
    ///
    /// # Safety
    /// No two live ranges may overlap.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn range(&self, start: usize, len: usize) -> &'a mut [T] {
        assert!(start <= self.len);
        let len = len.min(self.len - start);
        std::slice::from_raw_parts_mut(self.ptr.add(start), len)
    }
}

/// The next range of task indices from the front (the caller) or the back (a worker), if any is left,
/// `sizes` long.
fn claim(claims: &AtomicU64, front: bool, sizes: Chunks) -> Option<(usize, usize)> {
    let mut c = claims.load(SeqCst);
    loop {
        let (f, b) = (c & 0xffff_ffff, c >> 32);
        if f >= b {
            return None;
        }
        let n = sizes.size((b - f) as usize) as u64;
        let (next, range) = if front {
            (c + n, (f, f + n))
        } else {
            (c - (n << 32), (b - n, b))
        };
        match claims.compare_exchange_weak(c, next, SeqCst, SeqCst) {
            Ok(_) => return Some((range.0 as usize, range.1 as usize)),
            Err(now) => c = now,
        }
    }
}

/// Prefetches the hinted bytes, 1 KiB at a time, until they are done or a job comes (`epoch` moves).
fn follow_hint(s: &Shared, seen: u64) {
    let (ptr, len) = (s.hint_ptr.load(SeqCst), s.hint_len.load(SeqCst));
    let mut at = 0;
    while at < len && s.epoch.load(SeqCst) == seen {
        let n = (len - at).min(1024);
        super::prefetch_l1((ptr + at) as *const u8, n);
        at += n;
    }
}

fn worker(s: &Shared) {
    let mut seen = s.epoch.load(SeqCst);
    let mut hint_seen = s.hint_seq.load(SeqCst);
    loop {
        // Wait for a new job: spin, then park.
        let start = Instant::now();
        let mut spins = 0u32;
        while s.epoch.load(SeqCst) == seen {
            let h = s.hint_seq.load(SeqCst);
            if h != hint_seen {
                hint_seen = h;
                follow_hint(s, seen);
                continue;
            }
            spins = spins.wrapping_add(1);
            if spins > YIELD_AFTER {
                // Still responsive (a yield is about a microsecond), but a machine with more runnable
                // threads than cores gets the core back.
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            if spins.is_multiple_of(64) && start.elapsed() > SPIN {
                let mut l = s.lock.lock().unwrap();
                s.sleeping.fetch_add(1, SeqCst);
                while s.epoch.load(SeqCst) == seen {
                    l = s.wake.wait(l).unwrap();
                }
                s.sleeping.fetch_sub(1, SeqCst);
                break;
            }
        }
        seen = s.epoch.load(SeqCst);
        s.active.fetch_add(1, SeqCst);
        if s.open.load(SeqCst) {
            // SAFETY: see `Pool::run_in`: while we are active and the job is open, it stays valid.
            let job = unsafe { *s.job.get() };
            let f = unsafe { &*job.f };
            while let Some((a, b)) = claim(&s.claims, false, job.sizes) {
                f(a, b);
            }
        }
        s.active.fetch_sub(1, SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_meet_in_the_middle() {
        for tasks in [0u64, 1, 2, 7] {
            let claims = AtomicU64::new(tasks << 32);
            let mut got = Vec::new();
            // Alternating ends: the front counts up, the back down, and nothing is claimed twice.
            let mut front = true;
            while let Some((i, end)) = claim(&claims, front, Chunks::ONE) {
                assert_eq!(end, i + 1);
                got.push((front, i));
                front = !front;
            }
            let fronts: Vec<usize> = got.iter().filter(|g| g.0).map(|g| g.1).collect();
            let backs: Vec<usize> = got.iter().filter(|g| !g.0).map(|g| g.1).collect();
            let n = tasks as usize;
            assert_eq!(fronts, (0..n.div_ceil(2)).collect::<Vec<_>>(), "{tasks} tasks");
            assert_eq!(
                backs,
                (n.div_ceil(2)..n).rev().collect::<Vec<_>>(),
                "{tasks} tasks"
            );
            assert_eq!(claim(&claims, true, Chunks::ONE), None);
            assert_eq!(claim(&claims, false, Chunks::ONE), None);
        }
    }

    #[test]
    fn ranges_shrink_as_the_ends_meet() {
        // One thread claiming from either end in turn, as two threads at the same speed would.
        for (units, min) in [(1000usize, 4usize), (37, 1), (5, 8), (1, 1)] {
            let claims = AtomicU64::new((units as u64) << 32);
            let sizes = Chunks { min, div: 4 };
            let mut got = Vec::new();
            let mut front = true;
            while let Some((a, b)) = claim(&claims, front, sizes) {
                got.push((front, a, b));
                front = !front;
            }
            let lens: Vec<usize> = got.iter().map(|&(_, a, b)| b - a).collect();
            assert_eq!(
                lens[0],
                (units / 4).max(min).min(units),
                "{units} units: a quarter first"
            );
            assert!(lens.windows(2).all(|w| w[1] <= w[0]), "{units} units: {lens:?}");
            assert!(lens[..lens.len() - 1].iter().all(|&n| n >= min), "{lens:?}");
            assert!(
                *lens.last().unwrap() <= min,
                "{units} units: the ends meet in small steps"
            );
            // Each end's ranges follow on from its end, and the two meet with nothing left over.
            let mut next_front = 0;
            let mut next_back = units;
            for &(front, a, b) in &got {
                if front {
                    assert_eq!(a, next_front);
                    next_front = b;
                } else {
                    assert_eq!(b, next_back);
                    next_back = a;
                }
            }
            assert_eq!(next_front, next_back, "{units} units");
        }
    }

    #[test]
    fn ranges_cover_every_unit_once() {
        let pool = Pool::new(3);
        for units in [0, 1, 2, 5, 64, 1000, 100_000] {
            for min in [1, 7] {
                let hits: Vec<AtomicUsize> = (0..units).map(|_| AtomicUsize::new(0)).collect();
                let calls = AtomicUsize::new(0);
                pool.run_ranges(units, min, &|a, b| {
                    assert!(a < b && b <= units, "{a}..{b} of {units}");
                    calls.fetch_add(1, SeqCst);
                    hits[a..b].iter().for_each(|h| {
                        h.fetch_add(1, SeqCst);
                    });
                });
                assert!(
                    hits.iter().all(|h| h.load(SeqCst) == 1),
                    "{units} units, min {min}"
                );
                // Shrinking shares: a few dozen claims, not one per unit.
                assert!(calls.load(SeqCst) <= 200, "{units} units: {calls:?} ranges");
            }
        }
    }

    #[test]
    fn hints_leave_jobs_whole() {
        let pool = Pool::new(2);
        let data = vec![7u8; 1 << 20];
        for round in 0..200 {
            // Hints at any offset, between jobs.
            pool.prefetch_hint(&data[round * 997 % 4096..]);
            let hits: Vec<AtomicUsize> = (0..37).map(|_| AtomicUsize::new(0)).collect();
            pool.run(hits.len(), &|i| {
                hits[i].fetch_add(1, SeqCst);
            });
            assert!(hits.iter().all(|h| h.load(SeqCst) == 1), "round {round}");
        }
    }

    #[test]
    fn every_task_runs_once() {
        let pool = Pool::new(3);
        for tasks in [0, 1, 2, 5, 64, 1000] {
            let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            pool.run(tasks, &|i| {
                hits[i].fetch_add(1, SeqCst);
            });
            assert!(hits.iter().all(|h| h.load(SeqCst) == 1), "{tasks} tasks");
        }
    }

    #[test]
    fn concurrent_and_nested_callers_still_run_everything() {
        let pool = Arc::new(Pool::new(2));
        std::thread::scope(|sc| {
            for t in 0..4 {
                let pool = pool.clone();
                sc.spawn(move || {
                    for round in 0..200 {
                        let n = 1 + (t * 7 + round) % 13;
                        let total = AtomicUsize::new(0);
                        pool.run(n, &|i| {
                            // A nested job runs on this thread.
                            let inner = AtomicUsize::new(0);
                            pool.run(3, &|j| {
                                inner.fetch_add(j + 1, SeqCst);
                            });
                            total.fetch_add(i + inner.load(SeqCst), SeqCst);
                        });
                        assert_eq!(total.load(SeqCst), n * (n - 1) / 2 + 6 * n);
                    }
                });
            }
        });
    }

    #[test]
    fn workers_park_and_come_back() {
        let pool = Pool::new(2);
        let count = AtomicUsize::new(0);
        pool.run(4, &|_| {
            count.fetch_add(1, SeqCst);
        });
        // It parks after SPIN of idling; on a busy machine it may take a while to be scheduled.
        let start = Instant::now();
        while pool.shared.sleeping.load(SeqCst) != 1 && start.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(SPIN);
        }
        assert_eq!(pool.shared.sleeping.load(SeqCst), 1, "the idle worker parks");
        pool.run(4, &|_| {
            count.fetch_add(1, SeqCst);
        });
        assert_eq!(count.load(SeqCst), 8);
    }
}
