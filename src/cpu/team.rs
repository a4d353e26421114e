//! A team of spinning threads for the CPU forward's kernels.
//!
//! One forward of SmolLM2 runs about 200 parallel kernels (matmuls, attention, activation
//! quantisation), each a few to a few hundred microseconds. Rayon parks an idle worker on a
//! futex within microseconds, so nearly every kernel paid a wake-up: a `futex_wake` system call on
//! the critical path and the sleeper's reschedule, about a sixth of the CPU time of a forward in
//! `perf` (the same way llama.cpp's and OpenMP's thread pools avoid it: spin while work is near).
//! Team workers spin on one atomic between kernels and park only after 2 ms without work, so
//! a running forward keeps them hot and an idle program costs nothing.
//!
//! A job is `tasks` calls of one closure, claimed one at a time from a shared cursor; the caller
//! takes tasks too and returns when every task is done. Which thread runs a task never changes
//! what it computes, so results are the same bits with any number of threads. One job runs at a
//! time: a call made while another thread's job runs (tests in parallel) or from inside a task
//! runs its tasks on the calling thread instead of waiting.
use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a worker spins for the next job before parking: longer than the gaps inside a
/// forward and between the forwards of a decoding loop, short enough to give the core back soon
/// after a program stops calling kernels. `SELFSPEC_SPIN_US` overrides it (0: park at once, as
/// rayon does, for machines shared with other busy programs).
const SPIN: Duration = Duration::from_millis(2);

fn spin() -> Duration {
    static S: OnceLock<Duration> = OnceLock::new();
    *S.get_or_init(|| match std::env::var("SELFSPEC_SPIN_US") {
        Ok(v) => v.trim().parse().map(Duration::from_micros).unwrap_or_else(|_| {
            eprintln!("warning: SELFSPEC_SPIN_US={v:?} is not a whole number of microseconds; spinning {} us", SPIN.as_micros());
            SPIN
        }),
        Err(_) => SPIN,
    })
}

/// Spins between `sched_yield` calls, so that a thread the OS wants to run on this core (a rayon
/// worker of a candle op, another process) is not locked out for a whole time slice.
const SPINS_PER_YIELD: u32 = 2048;

/// The cursor packs `job | tasks | next` into one atomic: 24 bits numbering the job (wrapping),
/// 20 for its task count and 20 for the next unclaimed task. With the count inside, a claim
/// (a compare-and-swap of the whole word) can only succeed against the job its claimer read.
const FIELD_BITS: u32 = 20;
const FIELD_MASK: u64 = (1 << FIELD_BITS) - 1;
const JOB_SHIFT: u32 = 2 * FIELD_BITS;

/// Most tasks one job may have.
pub const MAX_TASKS: usize = FIELD_MASK as usize;

/// Row-wise elementwise passes (activation quantizing, SwiGLU) split over the thread team from
/// this many values on. Below it a split costs more than the work (with rayon, which ran these
/// before the team, a fork and join took tens of microseconds when the other thread slept): a 4-row verify forward forked about 120 times for under
/// 0.1 µs of work each, and a 4-row call on a 3072 x 576 Q8_0 weight took 0.080 ms with those
/// forks, 0.031 ms without. Rows are independent, so either way gives the same bits.
pub(crate) const PAR_MIN_VALUES: usize = 1 << 14;

fn job_of(c: u64) -> u64 {
    c >> JOB_SHIFT
}
fn tasks_of(c: u64) -> usize {
    ((c >> FIELD_BITS) & FIELD_MASK) as usize
}
fn next_of(c: u64) -> usize {
    (c & FIELD_MASK) as usize
}

type Task<'a> = dyn Fn(usize) + Sync + 'a;

struct Shared {
    /// `job | tasks | next unclaimed task` (see [`FIELD_BITS`]).
    cursor: AtomicU64,
    done: AtomicUsize,
    /// The current job's closure, with its lifetime erased: written by the caller before the
    /// job is published, read by workers only after claiming one of its tasks, and the caller
    /// does not return (so the closure outlives every use) until all its tasks are done.
    job: UnsafeCell<Option<*const Task<'static>>>,
    panicked: AtomicBool,
    sleepers: AtomicUsize,
    park: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by the thread holding `Team::dispatch`, while no worker can
// claim a task (the published cursor belongs to a finished job), and read only after a claim.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

struct Team {
    shared: &'static Shared,
    workers: usize,
    /// Held by the thread whose job runs; also numbers the jobs.
    dispatch: Mutex<u64>,
}

fn team() -> &'static Team {
    static TEAM: OnceLock<Team> = OnceLock::new();
    TEAM.get_or_init(|| {
        let shared: &'static Shared = Box::leak(Box::new(Shared {
            cursor: AtomicU64::new(0),
            done: AtomicUsize::new(0),
            job: UnsafeCell::new(None),
            panicked: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            park: Mutex::new(()),
            wake: Condvar::new(),
        }));
        let mut workers = 0;
        for i in 1..threads() {
            let spawned = std::thread::Builder::new().name(format!("selfspec-team-{i}")).spawn(move || worker(shared));
            if spawned.is_ok() {
                workers += 1;
            }
        }
        Team { shared, workers, dispatch: Mutex::new(0) }
    })
}

/// Threads that run a job, the caller included: `RAYON_NUM_THREADS` when set (so one setting
/// governs candle's rayon pool and this team), else the machine's available parallelism.
pub fn threads() -> usize {
    static N: OnceLock<usize> = OnceLock::new();
    *N.get_or_init(|| {
        let machine = || std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        match std::env::var("RAYON_NUM_THREADS") {
            Ok(v) => match v.trim().parse::<usize>() {
                Ok(0) => machine(),
                Ok(n) => n,
                Err(_) => {
                    eprintln!("warning: RAYON_NUM_THREADS={v:?} is not a thread count; using {}", machine());
                    machine()
                }
            },
            Err(_) => machine(),
        }
    })
}

/// Run `f(0)`, ..., `f(tasks - 1)` across the team and return when all are done. Tasks may run
/// in any order and on any thread. A panic in a task is re-raised here once every task has
/// finished (so nothing borrowed by `f` is freed while another thread still uses it).
pub fn run(tasks: usize, f: &(dyn Fn(usize) + Sync)) {
    if tasks == 0 {
        return;
    }
    let team = team();
    let guard = if tasks > 1 && team.workers > 0 && tasks <= MAX_TASKS { team.dispatch.try_lock().ok() } else { None };
    let Some(mut job_no) = guard else {
        // On this thread alone (one task, no workers, or the team busy with another caller's
        // job): the same contract, every task runs and the first panic is re-raised after them.
        // Before, tasks after a panicking one were skipped here, so a caller saw different
        // effects depending on whether the team was free (a flaky test when tests ran at once).
        let mut first = None;
        for i in 0..tasks {
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| f(i))) {
                first.get_or_insert(p);
            }
        }
        if let Some(p) = first {
            std::panic::resume_unwind(p);
        }
        return;
    };
    let s = team.shared;
    *job_no += 1;
    let job = *job_no & (u64::MAX >> JOB_SHIFT);
    // SAFETY: see `Shared::job`. The transmute only erases the lifetime; `f` outlives the job
    // because this function waits for every task below before returning.
    unsafe {
        let erased: *const Task<'static> = std::mem::transmute::<*const Task<'_>, *const Task<'static>>(f as *const Task<'_>);
        *s.job.get() = Some(erased);
    }
    s.done.store(0, Ordering::Relaxed);
    s.cursor.store(job << JOB_SHIFT | (tasks as u64) << FIELD_BITS, Ordering::SeqCst);
    if s.sleepers.load(Ordering::SeqCst) > 0 {
        let _g = s.park.lock().unwrap_or_else(|e| e.into_inner());
        s.wake.notify_all();
    }
    work(s, job);
    while s.done.load(Ordering::Acquire) < tasks {
        std::hint::spin_loop();
    }
    unsafe { *s.job.get() = None };
    if s.panicked.swap(false, Ordering::AcqRel) {
        drop(job_no);
        panic!("a parallel kernel task panicked (its message is printed above)");
    }
}

/// `f(i, &mut items[i])` for every item, across the team: for splitting output buffers by rows
/// (each task gets its own item, so no two tasks touch the same memory).
pub fn for_each_mut<T: Send>(items: &mut [T], f: impl Fn(usize, &mut T) + Sync) {
    struct Items<T>(*mut T);
    // SAFETY: each task index is claimed once, so each item is reached by one thread only.
    unsafe impl<T: Send> Sync for Items<T> {}
    let base = Items(items.as_mut_ptr());
    let base = &base;
    run(items.len(), &|i| f(i, unsafe { &mut *base.0.add(i) }));
}

/// Claim and run tasks of job `job` until none is left.
fn work(s: &Shared, job: u64) {
    loop {
        let c = s.cursor.load(Ordering::Acquire);
        if job_of(c) != job || next_of(c) >= tasks_of(c) {
            return;
        }
        if s.cursor.compare_exchange_weak(c, c + 1, Ordering::AcqRel, Ordering::Acquire).is_err() {
            continue;
        }
        // SAFETY: the claim succeeded, so `job` is this job's closure and stays alive until the
        // `done` increment below.
        let f = unsafe { (*s.job.get()).expect("a published job has a closure") };
        let task = next_of(c);
        if catch_unwind(AssertUnwindSafe(|| unsafe { (*f)(task) })).is_err() {
            s.panicked.store(true, Ordering::Release);
        }
        s.done.fetch_add(1, Ordering::Release);
    }
}

fn worker(s: &'static Shared) {
    let spin_limit = spin();
    let mut seen = s.cursor.load(Ordering::Acquire) >> JOB_SHIFT;
    loop {
        let mut spins = 0u32;
        let mut since = Instant::now();
        let job = loop {
            let job = s.cursor.load(Ordering::Acquire) >> JOB_SHIFT;
            if job != seen {
                break job;
            }
            std::hint::spin_loop();
            spins += 1;
            if spins % SPINS_PER_YIELD == 0 || spin_limit.is_zero() {
                if since.elapsed() >= spin_limit {
                    let mut g = s.park.lock().unwrap_or_else(|e| e.into_inner());
                    s.sleepers.fetch_add(1, Ordering::SeqCst);
                    while s.cursor.load(Ordering::SeqCst) >> JOB_SHIFT == seen {
                        g = s.wake.wait(g).unwrap_or_else(|e| e.into_inner());
                    }
                    s.sleepers.fetch_sub(1, Ordering::SeqCst);
                    since = Instant::now();
                } else {
                    std::thread::yield_now();
                }
            }
        };
        seen = job;
        work(s, job);
    }
}

/// Tasks per thread in a matmul: few and long, so each streams a long contiguous run of weights
/// (the hardware prefetcher needs a run to ramp up), yet enough to balance the cores. With 2,
/// SmolLM2's 576-column matrices (36 panels, 9 groups of 4) split 3 ways, one thread taking
/// twice the other's share; with 4 they split 5 to 4 (f16 one-token forward 9.4 → 8.8–9.0 ms,
/// bf16 9.5–10.1 → 9.1–9.2 ms, native unchanged; interleaved A/B).
const TASKS_PER_THREAD: usize = 4;

/// Split `panels` into tasks of whole groups of `group` panels, run on the team.
pub(crate) fn for_each_panel_range(panels: usize, group: usize, f: impl Fn(usize, usize) + Sync) {
    let per_task = (panels.div_ceil(threads() * TASKS_PER_THREAD).max(group)).div_ceil(group) * group;
    let tasks = panels.div_ceil(per_task);
    run(tasks, &|t| {
        let p0 = t * per_task;
        f(p0, (p0 + per_task).min(panels));
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_task_runs_once_from_many_callers() {
        let callers: Vec<_> = (0..4)
            .map(|c| {
                std::thread::spawn(move || {
                    for round in 0..200 {
                        let n = 1 + (round * 7 + c) % 37;
                        let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
                        run(n, &|i| {
                            hits[i].fetch_add(1, Ordering::Relaxed);
                        });
                        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "caller {c} round {round}");
                    }
                })
            })
            .collect();
        for c in callers {
            c.join().unwrap();
        }
    }

    #[test]
    fn for_each_mut_gives_each_task_its_own_item() {
        let mut rows: Vec<Vec<usize>> = (0..37).map(|i| vec![0; i % 5 + 1]).collect();
        for_each_mut(&mut rows, |i, r| r.iter_mut().for_each(|v| *v += i + 1));
        for (i, r) in rows.iter().enumerate() {
            assert!(r.len() == i % 5 + 1 && r.iter().all(|&v| v == i + 1), "row {i}: {r:?}");
        }
    }

    #[test]
    fn nested_calls_and_idle_workers_still_finish() {
        let total = AtomicU32::new(0);
        run(6, &|_| {
            run(5, &|_| {
                total.fetch_add(1, Ordering::Relaxed);
            })
        });
        assert_eq!(total.load(Ordering::Relaxed), 30);
        // Past the spin period the workers park; the next job must wake them.
        std::thread::sleep(SPIN * 3);
        let n = AtomicU32::new(0);
        run(64, &|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 64);
    }

    /// 16 tasks of which task 3 panics; the others count themselves in `finished`.
    fn sixteen_tasks_with_one_failing(finished: &AtomicU32) {
        run(16, &|i| {
            if i == 3 {
                panic!("task 3 fails on purpose");
            }
            finished.fetch_add(1, Ordering::Relaxed);
        })
    }

    #[test]
    fn a_panicking_task_is_reraised_after_the_others_finish() {
        let finished = AtomicU32::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| sixteen_tasks_with_one_failing(&finished)));
        assert!(r.is_err());
        assert_eq!(finished.load(Ordering::Relaxed), 15);
        // The team still works afterwards.
        let n = AtomicU32::new(0);
        run(8, &|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 8);
    }

    /// A call made while the team is busy (here from inside a task) runs on its own thread,
    /// with the same contract: the other tasks still run, then the panic is re-raised.
    #[test]
    fn a_panic_in_a_call_on_a_busy_team_runs_the_rest_first() {
        let finished = AtomicU32::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            run(2, &|outer| {
                if outer == 0 {
                    sixteen_tasks_with_one_failing(&finished)
                }
            })
        }));
        assert!(r.is_err());
        assert_eq!(finished.load(Ordering::Relaxed), 15);
    }
}
