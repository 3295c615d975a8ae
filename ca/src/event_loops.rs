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
//! run), the request is run there instead ([`SpareLoops::claim`]). Under even
//! load no loop is idle and nothing moves.
//!
//! ```no_run
//! # fn main() -> std::io::Result<()> {
//! let loops = meshca_ca::event_loops::EventLoops::start(2)?;
//! let spare = loops.spare();
//! loops.handle(0).spawn(async move {
//!     // On loop 0: run somewhere else if loop 0 is backed up and loop 1 idles.
//!     if let Some(idle) = spare.claim() {
//!         let _ = idle.spawn(async { /* the request */ }).await;
//!     }
//! });
//! loops.stop();
//! # Ok(())
//! # }
//! ```

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::runtime::Handle;

/// How long a loop must have been running without a pause before its
/// requests are handed to an idle loop: about one certificate's work, so
/// a loop that answers one request at a time keeps its requests (a
/// hand-off costs a wake-up of the other thread).
pub const BUSY_BEFORE_HANDOFF: Duration = Duration::from_micros(200);

thread_local! {
    /// The index of the loop this thread runs, if it runs one.
    static CURRENT_LOOP: Cell<Option<usize>> = const { Cell::new(None) };
}

/// What other threads know about one loop.
struct LoopState {
    /// Parked: no task to run, waiting for I/O or a timer.
    idle: AtomicBool,
    /// When the loop last woke up, in microseconds since `epoch`.
    busy_since_micros: AtomicU64,
}

/// The loops' shared state.
struct Shared {
    epoch: Instant,
    /// Shared with the loops' park hooks, which write it.
    states: Arc<[LoopState]>,
    handles: Vec<Handle>,
}

impl Shared {
    fn micros_now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }
}

/// The running loops. Dropping this stops them too, without waiting for
/// their threads.
pub struct EventLoops {
    shared: Arc<Shared>,
    stops: Vec<tokio::sync::oneshot::Sender<()>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for EventLoops {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventLoops")
            .field("loops", &self.shared.handles.len())
            .finish_non_exhaustive()
    }
}

impl EventLoops {
    /// Starts `count` loops (at least one), each on a thread of its own.
    pub fn start(count: usize) -> std::io::Result<Self> {
        let count = count.max(1);
        let epoch = Instant::now();
        let states: Arc<[LoopState]> = (0..count)
            .map(|_| LoopState {
                idle: AtomicBool::new(false),
                busy_since_micros: AtomicU64::new(0),
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
                .on_thread_park(move || parked[index].idle.store(true, Ordering::Release))
                .on_thread_unpark(move || {
                    let state = &woken[index];
                    let micros = u64::try_from(epoch.elapsed().as_micros()).unwrap_or(u64::MAX);
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
                    let _ = runtime.block_on(stop_rx);
                })?;
            threads.push(thread);
        }
        Ok(Self {
            shared: Arc::new(Shared {
                epoch,
                states,
                handles,
            }),
            stops,
            threads,
        })
    }

    /// How many loops run.
    pub fn len(&self) -> usize {
        self.shared.handles.len()
    }

    /// Whether there are no loops (never: at least one is started).
    pub fn is_empty(&self) -> bool {
        self.shared.handles.is_empty()
    }

    /// Loop `index`'s runtime, to spawn work on it.
    ///
    /// # Panics
    /// If `index >= self.len()`.
    pub fn handle(&self, index: usize) -> &Handle {
        &self.shared.handles[index]
    }

    /// What a request needs to move to an idle loop.
    pub fn spare(&self) -> SpareLoops {
        SpareLoops {
            shared: self.shared.clone(),
        }
    }

    /// Stops the loops (tasks still on them are dropped) and waits for
    /// their threads.
    pub fn stop(self) {
        for stop in self.stops {
            let _ = stop.send(());
        }
        for thread in self.threads {
            let _ = thread.join();
        }
    }
}

/// Lets a request on one loop move to another that is idle.
#[derive(Clone)]
pub struct SpareLoops {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for SpareLoops {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpareLoops")
            .field("loops", &self.shared.handles.len())
            .finish()
    }
}

impl SpareLoops {
    /// Another loop to run the caller's request, if the caller runs on a
    /// loop that has been busy for [`BUSY_BEFORE_HANDOFF`] and another loop
    /// is idle. The loop returned is marked busy, so concurrent callers
    /// claim different loops (or none). `None`: run the request here.
    pub fn claim(&self) -> Option<Handle> {
        let current = CURRENT_LOOP.with(Cell::get)?;
        let shared = &*self.shared;
        let count = shared.states.len();
        if count < 2 {
            return None;
        }
        let busy_since = shared.states[current]
            .busy_since_micros
            .load(Ordering::Relaxed);
        let busy_for = shared.micros_now().saturating_sub(busy_since);
        if busy_for < BUSY_BEFORE_HANDOFF.as_micros() as u64 {
            return None;
        }
        (1..count)
            .map(|step| (current + step) % count)
            .find(|&other| {
                shared.states[other]
                    .idle
                    .compare_exchange(true, false, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            })
            .map(|other| shared.handles[other].clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loop_of_this_thread() -> Option<usize> {
        CURRENT_LOOP.with(Cell::get)
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
        let loops = EventLoops::start(2).unwrap();
        let spare = loops.spare();
        // Not on a loop: never moves.
        assert!(spare.claim().is_none());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        // Loop 0 just woke up for this task: it keeps it.
        let claim = spare.clone();
        let fresh = runtime
            .block_on(
                loops
                    .handle(0)
                    .spawn(async move { claim.claim().is_some() }),
            )
            .unwrap();
        assert!(!fresh, "a loop that just woke up handed its request away");

        // Loop 0 busy for longer than the threshold while loop 1 idles:
        // the request goes to loop 1, and only one caller gets loop 1.
        let claim = spare.clone();
        let moved = runtime
            .block_on(loops.handle(0).spawn(async move {
                std::thread::sleep(BUSY_BEFORE_HANDOFF * 3);
                let first = claim.claim();
                let second = claim.claim();
                let ran_on = match &first {
                    Some(idle) => idle
                        .spawn(async { loop_of_this_thread() })
                        .await
                        .ok()
                        .flatten(),
                    None => None,
                };
                (first.is_some(), second.is_some(), ran_on)
            }))
            .unwrap();
        assert_eq!(moved, (true, false, Some(1)));
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
