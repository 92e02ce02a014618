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
//! finish the step's serial work ([`Pool::prefetch_hint`]); the memory idles then otherwise.
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

/// The job being run: a borrowed closure (lifetime erased; see [`Pool::run`] for why that is sound).
/// Its tasks are counted in `Shared::claims`.
#[derive(Clone, Copy)]
struct Job {
    f: *const (dyn Fn(usize) + Sync),
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
// `open` set, both sequentially consistent (see `Pool::run`).
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
            job: UnsafeCell::new(Job { f: &|_| {} }),
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
    /// layer's norms, rope, residuals): the end of the next job's data, which the workers' share of that
    /// job reads first, since they claim its tasks from the back. Only a hint: a worker follows it while
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
        // (`claims` counts tasks in 32 bits.)
        let fits = u32::try_from(tasks).is_ok();
        let guard = if fits && tasks > 1 && self.threads > 1 && rayon::current_num_threads() > 1 {
            self.submit.try_lock().ok()
        } else {
            None
        };
        let Some(_guard) = guard else {
            (0..tasks).for_each(f);
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
                f: std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), *const (dyn Fn(usize) + Sync)>(
                    f,
                ),
            };
        }
        s.claims.store((tasks as u64) << 32, SeqCst);
        s.open.store(true, SeqCst);
        s.epoch.fetch_add(1, SeqCst);
        if s.sleeping.load(SeqCst) > 0 {
            let _l = s.lock.lock().unwrap();
            s.wake.notify_all();
        }
        while let Some(i) = claim(&s.claims, true) {
            f(i);
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

/// The next task index from the front (the caller) or the back (a worker), if any is left.
fn claim(claims: &AtomicU64, front: bool) -> Option<usize> {
    let mut c = claims.load(SeqCst);
    loop {
        let (f, b) = (c & 0xffff_ffff, c >> 32);
        if f >= b {
            return None;
        }
        let (next, i) = if front { (c + 1, f) } else { (c - (1 << 32), b - 1) };
        match claims.compare_exchange_weak(c, next, SeqCst, SeqCst) {
            Ok(_) => return Some(i as usize),
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
            // SAFETY: see `Pool::run`: while we are active and the job is open, it stays valid.
            let job = unsafe { *s.job.get() };
            let f = unsafe { &*job.f };
            while let Some(i) = claim(&s.claims, false) {
                f(i);
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
            while let Some(i) = claim(&claims, front) {
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
            assert_eq!(claim(&claims, true), None);
            assert_eq!(claim(&claims, false), None);
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
