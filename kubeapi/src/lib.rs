//! How meshca lives with the Kubernetes API server's failures (docs/cluster.md,
//! "When the Kubernetes API fails"): the same rules for every component.
//!
//! - **Start-up waits** ([`wait_for_api`]): a step that needs the API
//!   (the root Secret, OIDC discovery, the API discovery of
//!   [`check_served`]) is retried while the failure is one a restarting
//!   control plane gives (connection refused, a timeout, `403` while the
//!   new API server's RBAC caches fill, `404` of a namespace not created
//!   yet, `429`, `5xx`), with a short backoff, for at most
//!   `--kube-api-startup-timeout`; `/ready` says what is awaited. A
//!   failure no retry can fix (an unusable Secret, an API the server does
//!   not serve) ends the start at once with one clear error.
//! - **Watches** ([`WatchRetry`]): kube-runtime's watcher re-lists by
//!   itself after an error; between attempts meshca waits 100 ms, doubling
//!   up to [`MAX_WATCH_RETRY`] (2 s), so a watch is back within about two
//!   seconds of the API server. A `410 Gone` (the resource version
//!   expired, as after an API server restart) is re-listed at once. Failures
//!   are logged once, then once per [`FAILURE_LOG_INTERVAL`] with a
//!   count, and the recovery once.
//! - **Logs**: kube-client writes an ERROR for every failed HTTP request;
//!   meshca's components already log each failure (at WARN, aggregated as
//!   above), so those events are dropped ([`QUIET_CLIENT_DIRECTIVE`]).

use std::future::Future;
use std::time::{Duration, Instant};

use kube::runtime::watcher;

/// The longest wait between two attempts of a failing watch.
pub const MAX_WATCH_RETRY: Duration = Duration::from_secs(2);
/// The first wait after a watch failed.
pub const FIRST_WATCH_RETRY: Duration = Duration::from_millis(100);
/// A failing watch or start-up step logs at most one line per interval.
pub const FAILURE_LOG_INTERVAL: Duration = Duration::from_secs(30);
/// The longest wait between two attempts of a start-up step.
pub const MAX_STARTUP_RETRY: Duration = Duration::from_secs(2);

/// The `tracing` directive that drops kube-client's own ERROR line per
/// failed HTTP request (meshca logs each failure itself, aggregated).
pub const QUIET_CLIENT_DIRECTIVE: &str = "kube_client::client::builder=off";

/// The `tracing` filter directives for `directives` (what `MESHCA_LOG`
/// says, `info` when unset): kube-client's own per-request ERROR lines
/// dropped ([`QUIET_CLIENT_DIRECTIVE`]) unless the directives name
/// `kube_client`.
///
/// ```
/// assert_eq!(
///     meshca_kube::log_directives(Some("debug")),
///     "debug,kube_client::client::builder=off"
/// );
/// assert_eq!(meshca_kube::log_directives(Some("kube_client=trace")), "kube_client=trace");
/// ```
pub fn log_directives(directives: Option<&str>) -> String {
    match directives {
        Some(d) if d.contains("kube_client") => d.to_string(),
        Some(d) => format!("{d},{QUIET_CLIENT_DIRECTIVE}"),
        None => format!("info,{QUIET_CLIENT_DIRECTIVE}"),
    }
}

/// Whether a failed API call is worth retrying during start-up: the API
/// server is unreachable, starting or overloaded, its RBAC caches are not
/// filled yet (`403`), or the namespace does not exist yet (`404`).
pub fn is_transient(error: &kube::Error) -> bool {
    match error {
        kube::Error::Api(status) => matches!(status.code, 403 | 404 | 408 | 429 | 500..=599),
        kube::Error::HyperError(_)
        | kube::Error::Service(_)
        | kube::Error::HttpError(_)
        | kube::Error::ReadEvents(_) => true,
        _ => false,
    }
}

/// A short, actionable reading of an API failure for logs and `/ready`
/// (never a token: kube errors carry none).
pub fn describe(error: &kube::Error) -> String {
    match error {
        kube::Error::Api(status) if status.code == 403 => format!(
            "403 Forbidden: {} (meshca's RBAC: deploy/kustomize/base/rbac.yaml; a starting API server answers 403 for a few seconds)",
            status.message
        ),
        kube::Error::Api(status) => format!("{} {}", status.code, status.message),
        other => meshca_certs::error_chain(other),
    }
}

/// A start-up step's failure: retry it, or give up at once.
#[derive(Debug)]
pub enum StepError<E> {
    /// Retry (the API server may come back or finish starting).
    Transient(String),
    /// Do not retry: this error ends the start.
    Fatal(E),
}

/// Runs `step` until it succeeds, a [`StepError::Fatal`] comes, or
/// `timeout` has passed since the first attempt (then the last transient
/// failure is returned through `give_up`). Each failure is published on
/// `waiting` (what `/ready` shows) and logged, at most once per
/// [`FAILURE_LOG_INTERVAL`].
pub async fn wait_for_api<T, E, F, Fut>(
    what: &'static str,
    timeout: Duration,
    waiting: &tokio::sync::watch::Sender<Option<String>>,
    give_up: impl FnOnce(String) -> E,
    mut step: F,
) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, StepError<E>>>,
{
    let started = Instant::now();
    let mut delay = FIRST_WATCH_RETRY;
    let mut last_logged: Option<Instant> = None;
    let mut attempts = 0u64;
    loop {
        attempts += 1;
        match step().await {
            Ok(value) => {
                if attempts > 1 {
                    tracing::info!(
                        step = what,
                        attempts,
                        waited_ms = started.elapsed().as_millis() as u64,
                        "the Kubernetes API answered; start-up goes on"
                    );
                }
                waiting.send_replace(None);
                return Ok(value);
            }
            Err(StepError::Fatal(e)) => return Err(e),
            Err(StepError::Transient(reason)) => {
                if started.elapsed() >= timeout {
                    return Err(give_up(format!(
                        "{what}: the Kubernetes API did not answer within --kube-api-startup-timeout ({}s, {attempts} attempts); last: {reason}",
                        timeout.as_secs()
                    )));
                }
                if last_logged.is_none_or(|at| at.elapsed() >= FAILURE_LOG_INTERVAL) {
                    last_logged = Some(Instant::now());
                    tracing::warn!(
                        step = what,
                        attempts,
                        error = %reason,
                        "waiting for the Kubernetes API before serving; retrying"
                    );
                }
                waiting.send_replace(Some(format!("{what}: {reason}")));
                tokio::time::sleep(jittered(delay)).await;
                delay = (delay * 2).min(MAX_STARTUP_RETRY);
            }
        }
    }
}

/// Checks by API discovery that the API server serves `resources` of
/// `group_version` (`needed_by` names the flag that needs them). Not
/// served: [`StepError::Fatal`] naming what is missing and what the API
/// server does serve of that group.
pub async fn check_served(
    client: &kube::Client,
    group_version: &str,
    resources: &[&str],
    needed_by: &str,
) -> Result<(), StepError<String>> {
    let not_served = |served: &str| {
        format!(
            "{needed_by} needs the Kubernetes API to serve {} of {group_version}, and it does not ({served}); kube-apiserver 1.35 or newer serves them with --feature-gates=PodCertificateRequest=true,ClusterTrustBundle=true --runtime-config={group_version}=true",
            resources.join(", ")
        )
    };
    match client.list_api_group_resources(group_version).await {
        Ok(list) => {
            let served: Vec<&str> = list.resources.iter().map(|r| r.name.as_str()).collect();
            let missing: Vec<&str> = resources
                .iter()
                .copied()
                .filter(|r| !served.contains(r))
                .collect();
            if missing.is_empty() {
                Ok(())
            } else {
                Err(StepError::Fatal(not_served(&format!(
                    "missing: {}; served: {}",
                    missing.join(", "),
                    served.join(", ")
                ))))
            }
        }
        Err(kube::Error::Api(status)) if status.code == 404 => Err(StepError::Fatal(not_served(
            &format!("{group_version} is not served at all"),
        ))),
        Err(e) if is_transient(&e) => Err(StepError::Transient(describe(&e))),
        Err(e) => Err(StepError::Fatal(format!(
            "API discovery of {group_version}: {}",
            describe(&e)
        ))),
    }
}

/// Pacing and logging of one watch's retries (see the module doc).
#[derive(Debug)]
pub struct WatchRetry {
    watch: &'static str,
    delay: Duration,
    failing_since: Option<Instant>,
    failures: u64,
    unlogged: u64,
    last_logged: Option<Instant>,
    last_was_gone: bool,
}

impl WatchRetry {
    /// The retries of the watch named `watch` (for logs).
    pub fn new(watch: &'static str) -> Self {
        Self {
            watch,
            delay: FIRST_WATCH_RETRY,
            failing_since: None,
            failures: 0,
            unlogged: 0,
            last_logged: None,
            last_was_gone: false,
        }
    }

    /// Looks at one item of the watch: an event that shows the API
    /// server answered (see [`answered`]) ends a run of failures.
    pub fn saw<K>(&mut self, event: &Result<watcher::Event<K>, watcher::Error>) {
        if answered(event) {
            self.succeeded();
        }
    }

    /// The API server answered: the watch works.
    pub fn succeeded(&mut self) {
        self.delay = FIRST_WATCH_RETRY;
        self.last_was_gone = false;
        if let Some(since) = self.failing_since.take() {
            tracing::info!(
                watch = self.watch,
                failures = self.failures,
                failing_ms = since.elapsed().as_millis() as u64,
                "the watch works again"
            );
            self.failures = 0;
            self.unlogged = 0;
            self.last_logged = None;
        }
    }

    /// The watch failed with `error`: logs (aggregated) and waits before
    /// the watcher's next attempt. A first `410 Gone` is re-listed at once.
    pub async fn failed(&mut self, error: &watcher::Error) {
        let gone = is_gone(error);
        if gone && !self.last_was_gone {
            self.last_was_gone = true;
            tracing::debug!(
                watch = self.watch,
                "resource version expired (410): listing again"
            );
            return;
        }
        self.last_was_gone = gone;
        self.failures += 1;
        self.failing_since.get_or_insert_with(Instant::now);
        if self
            .last_logged
            .is_none_or(|at| at.elapsed() >= FAILURE_LOG_INTERVAL)
        {
            self.last_logged = Some(Instant::now());
            tracing::warn!(
                watch = self.watch,
                error = %describe_watch(error),
                failures = self.failures,
                not_logged = self.unlogged,
                "watching the Kubernetes API failed; retrying"
            );
            self.unlogged = 0;
        } else {
            self.unlogged += 1;
        }
        tokio::time::sleep(jittered(self.delay)).await;
        self.delay = (self.delay * 2).min(MAX_WATCH_RETRY);
    }

    /// Whether the watch is failing now.
    #[cfg(test)]
    pub fn failing(&self) -> bool {
        self.failing_since.is_some()
    }
}

/// Whether a watch item shows that the API server answered. `Init` does
/// not: kube-runtime yields it before the listing it starts, also when
/// that listing then fails (taking it for an answer would reset the
/// backoff, and the staleness of what the watch feeds, on every retry).
pub fn answered<K>(event: &Result<watcher::Event<K>, watcher::Error>) -> bool {
    matches!(event, Ok(e) if !matches!(e, watcher::Event::Init))
}

/// Whether the watch failed because its resource version expired.
fn is_gone(error: &watcher::Error) -> bool {
    match error {
        watcher::Error::WatchError(status) => status.code == 410,
        watcher::Error::InitialListFailed(kube::Error::Api(status))
        | watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status)) => status.code == 410,
        _ => false,
    }
}

fn describe_watch(error: &watcher::Error) -> String {
    match error {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => describe(e),
        other => meshca_certs::error_chain(other),
    }
}

/// `base` ± 20 %, so replicas that lost the API server together do not
/// come back in step.
fn jittered(base: Duration) -> Duration {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 2];
    let unit = if ring::rand::SystemRandom::new().fill(&mut bytes).is_ok() {
        f64::from(u16::from_le_bytes(bytes)) / f64::from(u16::MAX)
    } else {
        0.5
    };
    base.mul_f64(0.8 + 0.4 * unit)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: u16) -> Box<kube::core::Status> {
        Box::new(kube::core::Status::failure("test", "Test").with_code(code))
    }

    #[tokio::test(start_paused = true)]
    async fn a_first_410_relists_at_once_and_other_failures_back_off_up_to_the_cap() {
        let mut retry = WatchRetry::new("test");
        let started = tokio::time::Instant::now();
        retry.failed(&watcher::Error::WatchError(status(410))).await;
        assert_eq!(started.elapsed(), Duration::ZERO, "410 re-lists at once");
        assert!(!retry.failing());
        // A second 410 in a row backs off (no busy loop).
        retry.failed(&watcher::Error::WatchError(status(410))).await;
        assert!(started.elapsed() > Duration::ZERO);
        let mut waits = Vec::new();
        for _ in 0..10 {
            let before = tokio::time::Instant::now();
            retry.failed(&watcher::Error::WatchError(status(403))).await;
            waits.push(before.elapsed());
        }
        assert!(
            waits.iter().all(|w| *w <= MAX_WATCH_RETRY.mul_f64(1.2)),
            "{waits:?}"
        );
        assert!(waits[9] >= MAX_WATCH_RETRY.mul_f64(0.8), "{waits:?}");
        assert!(retry.failing());
        retry.succeeded();
        assert!(!retry.failing());
        let before = tokio::time::Instant::now();
        retry.failed(&watcher::Error::WatchError(status(500))).await;
        assert!(before.elapsed() <= FIRST_WATCH_RETRY.mul_f64(1.2));
    }

    #[tokio::test(start_paused = true)]
    async fn the_init_before_a_failing_listing_does_not_reset_the_backoff() {
        let mut retry = WatchRetry::new("test");
        let mut waits = Vec::new();
        for _ in 0..6 {
            retry.saw::<()>(&Ok(watcher::Event::Init));
            let before = tokio::time::Instant::now();
            let failure: Result<watcher::Event<()>, _> =
                Err(watcher::Error::WatchError(status(503)));
            retry.saw(&failure);
            if let Err(e) = &failure {
                retry.failed(e).await;
            }
            waits.push(before.elapsed());
        }
        assert!(waits[5] >= MAX_WATCH_RETRY.mul_f64(0.8), "{waits:?}");
        retry.saw::<()>(&Ok(watcher::Event::InitDone));
        assert!(!retry.failing());
    }

    #[test]
    fn start_up_retries_what_a_restarting_control_plane_answers_and_nothing_else() {
        let api = |code| kube::Error::Api(status(code));
        for code in [403, 404, 429, 500, 503] {
            assert!(is_transient(&api(code)), "{code}");
        }
        for code in [400, 401, 409, 422] {
            assert!(!is_transient(&api(code)), "{code}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_start_up_step_is_retried_until_it_answers_and_then_ready_is_cleared() {
        let (waiting, seen) = tokio::sync::watch::channel(None);
        let mut attempts = 0;
        let result: Result<u32, String> = wait_for_api(
            "test step",
            Duration::from_secs(60),
            &waiting,
            |reason| reason,
            || {
                attempts += 1;
                let now = attempts;
                async move {
                    if now < 4 {
                        Err(StepError::Transient("connection refused".into()))
                    } else {
                        Ok(now)
                    }
                }
            },
        )
        .await;
        assert_eq!(result, Ok(4));
        assert_eq!(*seen.borrow(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_start_up_step_gives_up_after_the_timeout_and_a_fatal_error_at_once() {
        let (waiting, _seen) = tokio::sync::watch::channel(None);
        let result: Result<(), String> = wait_for_api(
            "test step",
            Duration::from_secs(10),
            &waiting,
            |reason| reason,
            || async { Err(StepError::Transient("403 Forbidden".into())) },
        )
        .await;
        let reason = result.unwrap_err();
        assert!(reason.contains("--kube-api-startup-timeout"), "{reason}");
        assert!(reason.contains("403 Forbidden"), "{reason}");
        let mut attempts = 0;
        let result: Result<(), String> = wait_for_api(
            "test step",
            Duration::from_secs(10),
            &waiting,
            |reason| reason,
            || {
                attempts += 1;
                async { Err(StepError::Fatal("unusable".to_string())) }
            },
        )
        .await;
        assert_eq!(result, Err("unusable".into()));
        assert_eq!(attempts, 1);
    }
}
