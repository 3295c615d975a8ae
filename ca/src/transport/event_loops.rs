//! Event loops, one per core, that serve the gRPC connections, and the
//! hand-off of a request to a loop that has nothing to do.
//!
//! Each loop is a thread with a single-threaded tokio runtime. A connection
//! lives on one loop: its TLS records, HTTP/2 frames and requests are handled
//! on one thread, with warm caches and no wake-ups between threads (the
//! multi-threaded runtime moved a connection's tasks between its workers and
//! woke parked workers for each new stream: BENCHMARKS.md has the numbers).
//!
//! Pinning connections to loops would leave cores idle when one connection
//! carries most requests (ztunnel multiplexes a whole node on one), so a
//! request may move: when its loop has been busy without a pause for
//! [`BUSY_BEFORE_HANDOFF`] and another loop is idle (parked, with no task to
//! run, for at least [`IDLE_BEFORE_HELPING`]: a loop that parked only between
//! bursts of its own connections keeps itself free for them), the request is
//! run there instead ([`SpareLoops::claim`]); a loop
//! helping that way takes a second request while it works on the first, so
//! it never waits for the next one. Under even load loops park only briefly
//! and nothing moves.
//!
//! ```text
//! let loops = EventLoops::start(2)?;
//! let spare = loops.spare();
//! loops.handle(0).spawn(async move {
//!     // On loop 0: run somewhere else if loop 0 is backed up and loop 1 idles.
//!     if let Some(idle) = spare.claim() {
//!         let _ = idle.spawn(async { /* the request */ }).await;
//!     }
//! });
//! loops.stop();
//! ```

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::runtime::Handle;

/// How long a loop must have been running without a pause before its
/// requests are handed to an idle loop: about one certificate's work, so
/// a loop that answers one request at a time keeps its requests (a
/// hand-off costs a wake-up of the other thread).
pub(crate) const BUSY_BEFORE_HANDOFF: Duration = Duration::from_micros(200);

/// How long a loop must have been parked before it takes a request of
/// another loop (unless it is already helping). Under even load every loop
/// parks briefly between the bursts of its own connections; taking another
/// loop's request then only makes its own next burst wait behind it (at
/// concurrency 16 over 4 connections that cost ~0.9 ms of p99 and 5–10 %
/// throughput: BENCHMARKS.md). A loop with no busy connection of its own
/// (one connection carrying everything, ztunnel's case) idles far longer,
/// and once it helps it keeps helping: a loop that finished a handed request
/// less than this long ago may take the next at once.
pub(crate) const IDLE_BEFORE_HELPING: Duration = Duration::from_micros(1000);

thread_local! {
    /// The index of the loop this thread runs, if it runs one.
    static CURRENT_LOOP: Cell<Option<usize>> = const { Cell::new(None) };
}

/// What other threads know about one loop.
#[derive(Debug)]
struct LoopState {
    /// Parked: no task to run, waiting for I/O or a timer.
    idle: AtomicBool,
    /// When the loop last parked, in microseconds since `epoch`.
    idle_since_micros: AtomicU64,
    /// When the loop last woke up, in microseconds since `epoch`.
    busy_since_micros: AtomicU64,
    /// Requests handed to this loop by others and not finished yet.
    handed: AtomicUsize,
    /// When the loop last finished a request handed to it, in microseconds
    /// since `epoch` (0: never).
    last_helped_micros: AtomicU64,
}

/// The loops' shared state.
#[derive(Debug)]
struct Shared {
    epoch: Instant,
    /// [`BUSY_BEFORE_HANDOFF`] unless started otherwise.
    handoff_after_micros: u64,
    /// [`IDLE_BEFORE_HELPING`] unless started otherwise.
    help_after_idle_micros: u64,
    /// Shared with the loops' park hooks, which write it.
    states: Arc<[LoopState]>,
    handles: Vec<Handle>,
}

impl Shared {
    fn micros_now(&self) -> u64 {
        micros_since(self.epoch)
    }
}

/// Microseconds since `epoch`, the clock of the loops' time stamps.
fn micros_since(epoch: Instant) -> u64 {
    u64::try_from(epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// The running loops. Dropping this stops them too, without waiting for
/// their threads.
#[derive(Debug)]
pub(crate) struct EventLoops {
    shared: Arc<Shared>,
    stops: Vec<tokio::sync::oneshot::Sender<()>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl EventLoops {
    /// Starts `count` loops (at least one), each on a thread of its own.
    pub(crate) fn start(count: usize) -> std::io::Result<Self> {
        Self::start_with_handoff_after(count, BUSY_BEFORE_HANDOFF)
    }

    /// [`EventLoops::start`], with requests moving from a loop once it has
    /// been busy for `busy` instead of [`BUSY_BEFORE_HANDOFF`].
    pub(crate) fn start_with_handoff_after(count: usize, busy: Duration) -> std::io::Result<Self> {
        Self::start_with_thresholds(count, busy, IDLE_BEFORE_HELPING)
    }

    /// [`EventLoops::start`], with requests moving from a loop busy for
    /// `busy` to one parked for `idle` (instead of [`BUSY_BEFORE_HANDOFF`]
    /// and [`IDLE_BEFORE_HELPING`]).
    pub(crate) fn start_with_thresholds(
        count: usize,
        busy: Duration,
        idle: Duration,
    ) -> std::io::Result<Self> {
        let count = count.max(1);
        let epoch = Instant::now();
        let states: Arc<[LoopState]> = (0..count)
            .map(|_| LoopState {
                idle: AtomicBool::new(false),
                idle_since_micros: AtomicU64::new(0),
                busy_since_micros: AtomicU64::new(0),
                handed: AtomicUsize::new(0),
                last_helped_micros: AtomicU64::new(0),
            })
            .collect();
        let mut handles = Vec::with_capacity(count);
        let mut stops = Vec::with_capacity(count);
        let mut threads = Vec::with_capacity(count);
        for index in 0..count {
            let parked = states.clone();
            let woken = states.clone();
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .on_thread_park(move || {
                    // Out of work: the log lines of this turn go out now.
                    super::log_lines::write_gathered();
                    let state = &parked[index];
                    let micros = micros_since(epoch);
                    state.idle_since_micros.store(micros, Ordering::Relaxed);
                    state.idle.store(true, Ordering::Release);
                })
                .on_thread_unpark(move || {
                    let state = &woken[index];
                    let micros = micros_since(epoch);
                    state.busy_since_micros.store(micros, Ordering::Relaxed);
                    state.idle.store(false, Ordering::Release);
                })
                .build()?;
            handles.push(runtime.handle().clone());
            let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
            stops.push(stop_tx);
            let thread = std::thread::Builder::new()
                .name(format!("meshca-loop-{index}"))
                .spawn(move || {
                    CURRENT_LOOP.with(|current| current.set(Some(index)));
                    super::log_lines::gather_on_this_thread();
                    let _ = runtime.block_on(stop_rx);
                    drop(runtime);
                    super::log_lines::write_gathered();
                })?;
            threads.push(thread);
        }
        Ok(Self {
            shared: Arc::new(Shared {
                epoch,
                handoff_after_micros: u64::try_from(busy.as_micros()).unwrap_or(u64::MAX),
                help_after_idle_micros: u64::try_from(idle.as_micros()).unwrap_or(u64::MAX),
                states,
                handles,
            }),
            stops,
            threads,
        })
    }

    /// How many loops run.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.shared.handles.len()
    }

    /// Loop `index`'s runtime, to spawn work on it.
    ///
    /// # Panics
    /// If `index >= self.len()`.
    #[cfg(test)]
    pub(crate) fn handle(&self, index: usize) -> &Handle {
        &self.shared.handles[index]
    }

    /// Every loop's runtime, in index order.
    pub(crate) fn handles(&self) -> &[Handle] {
        &self.shared.handles
    }

    /// What a request needs to move to an idle loop.
    pub(crate) fn spare(&self) -> SpareLoops {
        SpareLoops {
            shared: self.shared.clone(),
        }
    }

    /// Stops the loops (tasks still on them are dropped) and waits for
    /// their threads.
    pub(crate) fn stop(self) {
        for stop in self.stops {
            let _ = stop.send(());
        }
        for thread in self.threads {
            let _ = thread.join();
        }
    }
}

/// Lets a request on one loop move to another that is idle.
#[derive(Clone, Debug)]
pub(crate) struct SpareLoops {
    shared: Arc<Shared>,
}

impl SpareLoops {
    /// Another loop to run the caller's request, if the caller runs on a
    /// loop that has been busy for [`BUSY_BEFORE_HANDOFF`] and another loop
    /// has been parked for [`IDLE_BEFORE_HELPING`] (or as started) or
    /// finished a request handed to it less than that long ago, or is
    /// already working for other loops and has fewer than
    /// [`HANDED_PER_LOOP`] such requests (so it has the next one at hand
    /// when it finishes: one busy connection keeps a helper loop busy).
    /// `None`: run the request here.
    pub(crate) fn claim(&self) -> Option<IdleLoop> {
        let current = CURRENT_LOOP.with(Cell::get)?;
        let shared = &*self.shared;
        let count = shared.states.len();
        if count < 2 {
            return None;
        }
        let busy_since = shared.states[current]
            .busy_since_micros
            .load(Ordering::Relaxed);
        let now = shared.micros_now();
        let busy_for = now.saturating_sub(busy_since);
        if busy_for < shared.handoff_after_micros {
            return None;
        }
        let helper = (1..count)
            .map(|step| (current + step) % count)
            .find(|&other| {
                let state = &shared.states[other];
                let handed = state.handed.load(Ordering::Acquire);
                if handed > 0 {
                    // Already helping: queue one more, never more.
                    handed < HANDED_PER_LOOP
                        && state
                            .handed
                            .compare_exchange(
                                handed,
                                handed + 1,
                                Ordering::AcqRel,
                                Ordering::Relaxed,
                            )
                            .is_ok()
                } else if state.idle.load(Ordering::Acquire)
                    && (now.saturating_sub(state.idle_since_micros.load(Ordering::Relaxed))
                        >= shared.help_after_idle_micros
                        || helped_recently(state, now, shared.help_after_idle_micros))
                    && state
                        .idle
                        .compare_exchange(true, false, Ordering::AcqRel, Ordering::Relaxed)
                        .is_ok()
                {
                    state.handed.fetch_add(1, Ordering::AcqRel);
                    true
                } else {
                    false
                }
            })?;
        Some(IdleLoop {
            shared: self.shared.clone(),
            index: helper,
        })
    }
}

/// Whether `state`'s loop finished a handed request less than `window`
/// microseconds before `now`: a loop helping a busy one (one connection
/// carrying everything) parks between the requests it is given, and must
/// not have to idle for [`IDLE_BEFORE_HELPING`] again before the next.
fn helped_recently(state: &LoopState, now: u64, window: u64) -> bool {
    let last = state.last_helped_micros.load(Ordering::Relaxed);
    last != 0 && now.saturating_sub(last) < window
}

/// Most requests handed to one helper loop at a time.
pub(crate) const HANDED_PER_LOOP: usize = 2;

/// A loop claimed by [`SpareLoops::claim`] for one request.
#[derive(Debug)]
pub(crate) struct IdleLoop {
    shared: Arc<Shared>,
    index: usize,
}

impl IdleLoop {
    /// Runs the request on the claimed loop.
    pub(crate) fn spawn<F>(self, request: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let handle = self.shared.handles[self.index].clone();
        handle.spawn(async move {
            let _done = self; // releases the claim when the request ends
            let output = request.await;
            // Its log lines go out before the answer reaches its own loop.
            super::log_lines::write_gathered();
            output
        })
    }
}

impl Drop for IdleLoop {
    fn drop(&mut self) {
        let state = &self.shared.states[self.index];
        state
            .last_helped_micros
            .store(self.shared.micros_now().max(1), Ordering::Relaxed);
        state.handed.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loop_of_this_thread() -> Option<usize> {
        CURRENT_LOOP.with(Cell::get)
    }

    /// Runs a request on the claimed loop, if any: the loop it ran on.
    async fn ran_on(claimed: Option<IdleLoop>) -> Option<usize> {
        let idle = claimed?;
        idle.spawn(async { loop_of_this_thread() })
            .await
            .ok()
            .flatten()
    }

    #[test]
    fn each_loop_runs_on_a_thread_of_its_own() {
        let loops = EventLoops::start(3).unwrap();
        assert_eq!(loops.len(), 3);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        for index in 0..3 {
            let seen = runtime
                .block_on(loops.handle(index).spawn(async {
                    (
                        loop_of_this_thread(),
                        std::thread::current().name().map(String::from),
                    )
                }))
                .unwrap();
            assert_eq!(seen.0, Some(index));
            assert_eq!(
                seen.1.as_deref(),
                Some(format!("meshca-loop-{index}").as_str())
            );
        }
        loops.stop();
    }

    #[test]
    fn a_request_moves_only_from_a_busy_loop_to_an_idle_one() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        // A loop that just woke up for a request keeps it (a threshold no
        // descheduling of this test's thread can reach).
        let patient = EventLoops::start_with_handoff_after(2, Duration::from_secs(60)).unwrap();
        let claim = patient.spare();
        let fresh = runtime
            .block_on(patient.handle(0).spawn(async move {
                std::thread::sleep(Duration::from_millis(5));
                claim.claim().is_some()
            }))
            .unwrap();
        assert!(!fresh, "a loop that just woke up handed its request away");
        patient.stop();

        let loops = EventLoops::start(2).unwrap();
        let spare = loops.spare();
        // Not on a loop: never moves.
        assert!(spare.claim().is_none());

        // Loop 0 busy for longer than the threshold while loop 1 idles:
        // the request goes to loop 1; one more may queue there, not a third.
        let claim = spare.clone();
        let moved = runtime
            .block_on(loops.handle(0).spawn(async move {
                // Long enough for loop 0 to count as busy and loop 1 (parked
                // since it started) as idle for long enough to help.
                std::thread::sleep(BUSY_BEFORE_HANDOFF * 3 + IDLE_BEFORE_HELPING);
                let first = claim.claim();
                let second = claim.claim();
                let third = claim.claim();
                let claimed = (first.is_some(), second.is_some(), third.is_some());
                let ran_on = ran_on(first).await;
                // The first has finished: room for one more again (loop 0
                // waited for it, so it must be busy again first).
                std::thread::sleep(BUSY_BEFORE_HANDOFF * 3);
                let fourth = claim.claim().is_some();
                drop(second);
                (claimed, ran_on, fourth)
            }))
            .unwrap();
        assert_eq!(moved, ((true, true, false), Some(1), true));
        loops.stop();
    }

    #[test]
    fn a_loop_that_parked_only_just_now_is_left_alone() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        // Loop 0 busy well past the threshold in both cases; whether loop 1
        // helps depends only on how long it must have been parked.
        for (idle_for, expect_move) in [(Duration::from_secs(60), false), (Duration::ZERO, true)] {
            let loops =
                EventLoops::start_with_thresholds(2, Duration::from_micros(100), idle_for).unwrap();
            let claim = loops.spare();
            let moved = runtime
                .block_on(loops.handle(0).spawn(async move {
                    std::thread::sleep(Duration::from_millis(2));
                    claim.claim().map(|idle| idle.index)
                }))
                .unwrap();
            assert_eq!(
                moved,
                expect_move.then_some(1),
                "idle threshold {idle_for:?}"
            );
            loops.stop();
        }
    }

    #[test]
    fn a_loop_that_just_helped_may_help_again_at_once() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let idle_for = Duration::from_millis(200);
        let loops =
            EventLoops::start_with_thresholds(2, Duration::from_micros(100), idle_for).unwrap();
        let claim = loops.spare();
        let moved = runtime
            .block_on(loops.handle(0).spawn(async move {
                // Loop 1 idle for longer than the threshold: it helps.
                std::thread::sleep(idle_for + Duration::from_millis(10));
                let first = ran_on(claim.claim()).await;
                // Loop 1 parked again just now, far less than 200 ms ago, but
                // it has just helped: it takes the next one too.
                std::thread::sleep(Duration::from_millis(2));
                let second = claim.claim().map(|idle| idle.index);
                (first, second)
            }))
            .unwrap();
        assert_eq!(moved, (Some(1), Some(1)));
        loops.stop();
    }

    #[test]
    fn one_loop_keeps_everything() {
        let loops = EventLoops::start(1).unwrap();
        let spare = loops.spare();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let moved = runtime
            .block_on(loops.handle(0).spawn(async move {
                std::thread::sleep(BUSY_BEFORE_HANDOFF * 2);
                spare.claim().is_some()
            }))
            .unwrap();
        assert!(!moved);
        loops.stop();
    }
}
