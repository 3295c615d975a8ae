//! [`Feeds`]: one [`Feed`] per identity that some stream watches, on top of
//! the [`CertManager`] (one renewal loop per identity, however many streams
//! watch it) and the watched `--root-cert` bundle.
//!
//! A feed turns the manager's certificate and the file's bundle into a
//! [`FeedState`], once per change, for every stream of that identity: the
//! roots (known from the file before any certificate) and the certificate's
//! state ([`SvidState`]: pending, ready, refused by the CA, or expired).
//! A certificate is never served past its notAfter: at that moment the
//! feed turns it into [`SvidState::Expired`] until a new one arrives.
//! A stream that closes keeps its identity's feed for [`FEED_LINGER`] more
//! ([`Feed::linger`]): a client that reconnects (the `spiffe` crate's
//! `X509Source` opens a second stream after its first answer; a pod
//! restarts its sidecar) gets the same certificate, not a new key and a new
//! CSR. After that, when no stream holds it, the feed is dropped, its task
//! ends and the identity leaves the manager (unless it is pinned, as the
//! configured identity of pod mode is).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use meshca_certs::{SpiffeId, TrustBundle};
use time::OffsetDateTime;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tonic::Status;

use super::credentials::{Credentials, Roots, ServedCrl};
use crate::issuer::{ClientError, Svid};
use crate::manager::{CertManager, CertState};

/// What one identity's streams serve at one moment.
#[derive(Debug, Clone)]
pub(crate) struct FeedState {
    /// Every root to trust: the last answer's and the file's (the file's
    /// alone before the first certificate).
    pub(crate) roots: Arc<Roots>,
    /// The certificate.
    pub(crate) svid: SvidState,
}

/// Where an identity's certificate stands.
#[derive(Debug, Clone)]
pub(crate) enum SvidState {
    /// None yet: the first fetch is under way, or being retried after the
    /// failure `last_error` says.
    Pending {
        /// Why the last fetch failed, if one did.
        last_error: Option<Arc<str>>,
    },
    /// A valid certificate.
    Ready(Arc<Credentials>),
    /// The CA refused the identity (`PermissionDenied`); still retried.
    Refused(Arc<str>),
    /// The certificate expired and no new one could be fetched yet.
    Expired(Arc<str>),
}

impl SvidState {
    /// The status to end a stream (or answer a call) with, for the states
    /// that have no certificate to serve and will not have one soon.
    pub(crate) fn failure(&self) -> Option<Status> {
        match self {
            Self::Refused(why) => Some(Status::permission_denied(why.to_string())),
            Self::Expired(why) => Some(Status::unavailable(why.to_string())),
            Self::Pending { .. } | Self::Ready(_) => None,
        }
    }

    fn same_as(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Pending { last_error: a }, Self::Pending { last_error: b }) => a == b,
            (Self::Ready(a), Self::Ready(b)) => !a.differs_from(b),
            (Self::Refused(a), Self::Refused(b)) | (Self::Expired(a), Self::Expired(b)) => a == b,
            _ => false,
        }
    }
}

/// A receiver of one identity's [`FeedState`].
pub(crate) type FeedWatch = watch::Receiver<FeedState>;

/// How long an identity's feed is kept after a stream of it closed: a
/// client that comes back within it gets the same certificate.
pub(crate) const FEED_LINGER: Duration = Duration::from_secs(300);

/// How often the feeds kept after their streams closed are looked at.
const LINGER_SWEEP: Duration = Duration::from_secs(30);

/// The live feeds, by identity.
#[derive(Debug)]
pub struct Feeds {
    manager: Arc<CertManager>,
    bundle: watch::Receiver<TrustBundle>,
    /// The CA's CRL to serve (`--crl-file`), if any.
    crl: watch::Receiver<Option<Arc<ServedCrl>>>,
    live: Mutex<HashMap<SpiffeId, Weak<Feed>>>,
    /// Feeds kept after a stream closed, until when; one entry per
    /// identity, so no larger than the identities served.
    lingering: Mutex<HashMap<SpiffeId, (Arc<Feed>, Instant)>>,
    /// Whether the task that lets them go runs.
    sweeping: std::sync::atomic::AtomicBool,
}

/// One identity's credentials for the streams that hold it.
#[derive(Debug)]
pub struct Feed {
    identity: SpiffeId,
    state: FeedWatch,
    task: JoinHandle<()>,
    feeds: Arc<Feeds>,
}

impl Feeds {
    /// Feeds over `manager`, trusting also the roots `bundle` holds.
    pub fn new(manager: Arc<CertManager>, bundle: watch::Receiver<TrustBundle>) -> Arc<Self> {
        Self::with_crl(manager, bundle, watch::channel(None).1)
    }

    /// As [`Feeds::new`], serving also the CRL `crl` holds (when it
    /// verifies with the roots or the answer's CA certificates).
    pub fn with_crl(
        manager: Arc<CertManager>,
        bundle: watch::Receiver<TrustBundle>,
        crl: watch::Receiver<Option<Arc<ServedCrl>>>,
    ) -> Arc<Self> {
        Arc::new(Self {
            manager,
            bundle,
            crl,
            live: Mutex::new(HashMap::new()),
            lingering: Mutex::new(HashMap::new()),
            sweeping: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Starts the task that lets the kept feeds go when their time is up
    /// (once; it ends with the feeds).
    fn start_sweeping(self: &Arc<Self>) {
        if self
            .sweeping
            .swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime here: the next feed kept tries again.
            self.sweeping
                .store(false, std::sync::atomic::Ordering::Release);
            return;
        };
        let weak = Arc::downgrade(self);
        runtime.spawn(async move {
            loop {
                tokio::time::sleep(LINGER_SWEEP).await;
                let Some(feeds) = weak.upgrade() else { return };
                feeds.let_go_of_lingering();
            }
        });
    }

    /// Keeps `feed` for [`FEED_LINGER`] from now.
    fn keep(self: &Arc<Self>, feed: &Arc<Feed>) {
        self.start_sweeping();
        let expired = {
            let mut lingering = self.lingering.lock().unwrap_or_else(|e| e.into_inner());
            lingering.insert(
                feed.identity.clone(),
                (feed.clone(), Instant::now() + FEED_LINGER),
            )
        };
        // Dropped outside the lock: it may be the feed's last holder.
        drop(expired);
    }

    /// Drops the kept feeds whose time is up.
    fn let_go_of_lingering(&self) {
        let now = Instant::now();
        let expired: Vec<(SpiffeId, (Arc<Feed>, Instant))> = {
            let mut lingering = self.lingering.lock().unwrap_or_else(|e| e.into_inner());
            let gone: Vec<SpiffeId> = lingering
                .iter()
                .filter(|(_, (_, until))| *until <= now)
                .map(|(identity, _)| identity.clone())
                .collect();
            gone.into_iter()
                .filter_map(|identity| lingering.remove_entry(&identity))
                .collect()
        };
        drop(expired);
    }

    /// The feed of `identity`, started (and the identity added to the
    /// manager) if no stream holds it yet.
    pub fn get(self: &Arc<Self>, identity: &SpiffeId) -> Arc<Feed> {
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(feed) = live.get(identity).and_then(Weak::upgrade) {
            return feed;
        }
        let certificates = self.manager.add(identity.clone());
        // The file's roots are served at once, before any certificate.
        let (tx, state) = watch::channel(FeedState {
            roots: Roots::new(None, &self.bundle.borrow(), self.crl.borrow().as_ref()),
            svid: SvidState::Pending { last_error: None },
        });
        let task = tokio::spawn(follow(
            identity.clone(),
            Arc::downgrade(&self.manager),
            certificates,
            self.bundle.clone(),
            self.crl.clone(),
            tx,
        ));
        let feed = Arc::new(Feed {
            identity: identity.clone(),
            state,
            task,
            feeds: self.clone(),
        });
        live.insert(identity.clone(), Arc::downgrade(&feed));
        feed
    }

    /// How many identities have a live feed.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.live.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether no identity has a live feed.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Feed {
    /// The identity.
    pub(crate) fn identity(&self) -> &SpiffeId {
        &self.identity
    }

    /// A receiver of the identity's state.
    pub(crate) fn state(&self) -> FeedWatch {
        self.state.clone()
    }

    /// A stream of this feed closed: keeps it for [`FEED_LINGER`], unless
    /// the CA refused the identity (a client that comes back after the
    /// operator mends its authorization gets a fresh request, at once).
    pub(crate) fn linger(self: &Arc<Self>) {
        if matches!(self.state.borrow().svid, SvidState::Refused(_)) {
            return;
        }
        self.feeds.keep(self);
    }
}

impl Drop for Feed {
    fn drop(&mut self) {
        self.task.abort();
        let mut live = self.feeds.live.lock().unwrap_or_else(|e| e.into_inner());
        // A new feed of the same identity may have replaced this one after
        // its last holder let go: then the identity stays managed.
        let replaced = live
            .get(&self.identity)
            .is_some_and(|weak| weak.strong_count() > 0);
        if !replaced {
            live.remove(&self.identity);
            self.feeds.manager.remove(&self.identity);
            tracing::debug!(identity = %self.identity, "last stream closed; identity released");
        }
    }
}

/// How long from now until `not_after` (zero if it has passed).
fn until(not_after: OffsetDateTime) -> Duration {
    Duration::try_from(not_after - OffsetDateTime::now_utc()).unwrap_or(Duration::ZERO)
}

/// The state a failed fetch leaves: a refusal by the CA, an expired
/// certificate (`had_one`), or still pending.
fn failed(identity: &SpiffeId, error: &ClientError, had_one: bool) -> SvidState {
    if matches!(
        error,
        ClientError::Rpc {
            code: tonic::Code::PermissionDenied,
            ..
        }
    ) {
        return SvidState::Refused(
            format!("the CA refused a certificate for {identity}: {error}").into(),
        );
    }
    if had_one {
        SvidState::Expired(
            format!("the certificate of {identity} expired and no new one could be fetched yet: {error}")
                .into(),
        )
    } else {
        SvidState::Pending {
            last_error: Some(error.to_string().into()),
        }
    }
}

/// Publishes the state of the manager's certificate with the file's
/// bundle, whenever either changes and when the certificate expires, until
/// every receiver is gone or the manager drops the identity.
async fn follow(
    identity: SpiffeId,
    manager: Weak<CertManager>,
    mut certificates: watch::Receiver<CertState>,
    mut bundle: watch::Receiver<TrustBundle>,
    mut crl: watch::Receiver<Option<Arc<ServedCrl>>>,
    tx: watch::Sender<FeedState>,
) {
    let mut bundle_open = true;
    let mut crl_open = true;
    // The last certificate seen (the manager forgets it once it fails).
    let mut last: Option<Arc<Svid>> = None;
    // The serial whose notAfter has passed.
    let mut expired: Option<String> = None;
    // The serial renewed early because the CRL lists it (or its CA).
    let mut renewed_revoked: Option<String> = None;
    loop {
        let state = certificates.borrow_and_update().clone();
        let file_bundle = bundle.borrow_and_update().clone();
        let served_crl = crl.borrow_and_update().clone();
        if let CertState::Available(svid) = &state {
            last = Some(svid.clone());
            // Revoked after it was published: renewed at once (once per
            // serial); served until then, with the CRL that lists it.
            if let Some(crl) = &served_crl {
                let serial = &svid.leaf.serial_hex;
                if renewed_revoked.as_ref() != Some(serial) {
                    if let Err(e) = crl.check_chain(svid, OffsetDateTime::now_utc()) {
                        tracing::warn!(identity = %identity, serial = %serial, error = %e, "the CRL lists the certificate in use: renewing it now");
                        renewed_revoked = Some(serial.clone());
                        if let Some(manager) = manager.upgrade() {
                            manager.renew_now(&identity);
                        }
                    }
                }
            }
        }
        let mut expires_at = None;
        let svid_state = match &state {
            CertState::Initializing => SvidState::Pending { last_error: None },
            CertState::Unavailable(error) => failed(&identity, error, last.is_some()),
            CertState::Available(svid) => {
                let left = until(svid.leaf.not_after);
                if left.is_zero() || expired.as_ref() == Some(&svid.leaf.serial_hex) {
                    SvidState::Expired(
                        format!(
                            "the certificate of {identity} expired at {} and no new one could be fetched yet",
                            svid.leaf.not_after
                        )
                        .into(),
                    )
                } else {
                    expires_at = Some(Instant::now() + left);
                    SvidState::Ready(Credentials::new(svid, &file_bundle, served_crl.as_ref()))
                }
            }
        };
        let fresh = FeedState {
            roots: match &svid_state {
                SvidState::Ready(credentials) => credentials.roots.clone(),
                _ => Roots::new(last.as_deref(), &file_bundle, served_crl.as_ref()),
            },
            svid: svid_state,
        };
        tx.send_if_modified(|current| {
            if current.roots == fresh.roots && current.svid.same_as(&fresh.svid) {
                return false;
            }
            if let Some(status) = fresh.svid.failure() {
                tracing::warn!(identity = %identity, code = ?status.code(), reason = %status.message(), "no certificate to serve");
            }
            *current = fresh;
            true
        });
        let expiry = async {
            match expires_at {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            changed = certificates.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            changed = bundle.changed(), if bundle_open => {
                bundle_open = changed.is_ok();
            }
            changed = crl.changed(), if crl_open => {
                crl_open = changed.is_ok();
            }
            () = expiry => {
                expired = last.as_ref().map(|svid| svid.leaf.serial_hex.clone());
            }
            _ = tx.closed() => return,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::issuer::{CertificateIssuer, ClientError, Svid};
    use crate::manager::ManagerConfig;
    use meshca_certs::profile::{self_signed_root, SigningCa, SubjectKey, SubjectName, Validity};
    use meshca_certs::{KeyAlgorithm, PrivateKey};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;
    use time::OffsetDateTime;

    /// Issues real certificates of a given lifetime from a test CA; fails
    /// every fetch with `fail` while it is set, never answers while `hang`
    /// is set.
    pub(crate) struct TestIssuer {
        pub(crate) ca: SigningCa,
        lifetime: Duration,
        pub(crate) calls: AtomicUsize,
        pub(crate) fail: Mutex<Option<tonic::Code>>,
        pub(crate) hang: std::sync::atomic::AtomicBool,
    }

    fn test_ca(name: &str) -> SigningCa {
        let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let root = self_signed_root(
            &key,
            &SubjectName {
                common_name: Some(name.into()),
                ..Default::default()
            },
            Validity::backdated(OffsetDateTime::now_utc(), time::Duration::days(10)),
        )
        .unwrap();
        SigningCa::new(root.der, key).unwrap()
    }

    #[async_trait::async_trait]
    impl CertificateIssuer for TestIssuer {
        async fn fetch(&self, identity: &SpiffeId) -> Result<Svid, ClientError> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if self.hang.load(Ordering::SeqCst) {
                std::future::pending::<()>().await;
            }
            if let Some(code) = *self.fail.lock().unwrap() {
                return Err(ClientError::Rpc {
                    code,
                    message: "scripted".into(),
                });
            }
            let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
            let now = OffsetDateTime::now_utc().replace_nanosecond(0).unwrap();
            let validity = Validity {
                not_before: now,
                not_after: now + time::Duration::try_from(self.lifetime).unwrap(),
            };
            let cert = self
                .ca
                .issue_workload(&SubjectKey::of(&key).unwrap(), identity, validity)
                .unwrap();
            let root_pem = meshca_certs::bundle::encode_cert_pem(self.ca.cert_der());
            Ok(Svid {
                key,
                chain_pem: vec![cert.to_pem(), root_pem],
                bundle: TrustBundle::new(vec![self.ca.cert_der().to_vec()]),
                leaf: meshca_certs::verify::check_svid_leaf(&cert.der).unwrap(),
            })
        }
    }

    pub(crate) fn id(name: &str) -> SpiffeId {
        SpiffeId::parse(&format!("spiffe://cluster.local/ns/test/sa/{name}")).unwrap()
    }

    /// An issuer of `lifetime` certificates, feeds over it, and the
    /// `--root-cert` bundle's sender (it holds the issuer's root).
    pub(crate) fn setup(
        lifetime: Duration,
    ) -> (Arc<TestIssuer>, Arc<Feeds>, watch::Sender<TrustBundle>) {
        let issuer = Arc::new(TestIssuer {
            ca: test_ca("root"),
            lifetime,
            calls: AtomicUsize::new(0),
            fail: Mutex::new(None),
            hang: std::sync::atomic::AtomicBool::new(false),
        });
        let manager = Arc::new(CertManager::new(
            issuer.clone(),
            ManagerConfig {
                renew_jitter: 0.0,
                ..ManagerConfig::default()
            },
        ));
        let (bundle_tx, bundle_rx) =
            watch::channel(TrustBundle::new(vec![issuer.ca.cert_der().to_vec()]));
        (issuer, Feeds::new(manager, bundle_rx), bundle_tx)
    }

    /// The next certificate the feed serves.
    pub(crate) async fn next(rx: &mut FeedWatch) -> Arc<Credentials> {
        loop {
            if let SvidState::Ready(c) = rx.borrow_and_update().svid.clone() {
                return c;
            }
            rx.changed().await.unwrap();
        }
    }

    fn ready(rx: &FeedWatch) -> Arc<Credentials> {
        match rx.borrow().svid.clone() {
            SvidState::Ready(c) => c,
            other => panic!("not ready: {other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn one_renewal_loop_per_identity_and_released_with_the_last_stream() {
        let (issuer, feeds, _bundle) = setup(Duration::from_secs(100));
        let streams: Vec<Arc<Feed>> = (0..50).map(|_| feeds.get(&id("web"))).collect();
        let mut rx = streams[0].state();
        let first = next(&mut rx).await;
        assert_eq!(first.spiffe_id, id("web"));
        assert_eq!(first.roots.der.len(), 1, "the answer's root");
        assert_eq!(
            issuer.calls.load(Ordering::SeqCst),
            1,
            "one fetch for 50 streams"
        );
        assert_eq!(feeds.len(), 1);
        // A rotation reaches every stream.
        rx.changed().await.unwrap();
        let second = ready(&rx);
        assert_ne!(second.serial_hex, first.serial_hex);
        assert_eq!(issuer.calls.load(Ordering::SeqCst), 2);
        for feed in &streams {
            assert_eq!(ready(&feed.state()).serial_hex, second.serial_hex);
        }
        drop(rx);
        drop(streams);
        assert!(feeds.is_empty());
        assert!(feeds.manager.is_empty(), "the identity left the manager");
        tokio::time::sleep(Duration::from_secs(500)).await;
        assert_eq!(
            issuer.calls.load(Ordering::SeqCst),
            2,
            "no renewal after release"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_feed_lingers_after_its_stream_closes() {
        let (issuer, feeds, _bundle) = setup(Duration::from_secs(3600));
        let feed = feeds.get(&id("web"));
        let first = next(&mut feed.state()).await;
        feed.linger();
        drop(feed);
        // A client back within the linger gets the same certificate.
        tokio::time::sleep(FEED_LINGER / 2).await;
        let again = feeds.get(&id("web"));
        assert_eq!(ready(&again.state()).serial_hex, first.serial_hex);
        assert_eq!(issuer.calls.load(Ordering::SeqCst), 1, "no new CSR");
        again.linger();
        drop(again);
        // Gone once the linger is over.
        tokio::time::sleep(FEED_LINGER + LINGER_SWEEP * 2).await;
        assert!(feeds.is_empty());
        assert!(feeds.manager.is_empty(), "the identity left the manager");
    }

    #[tokio::test(start_paused = true)]
    async fn a_bundle_change_is_published_without_a_new_certificate() {
        let (issuer, feeds, bundle) = setup(Duration::from_secs(3600));
        let feed = feeds.get(&id("web"));
        let mut rx = feed.state();
        let first = next(&mut rx).await;
        let second_root = test_ca("second root").cert_der().to_vec();
        bundle.send_replace(TrustBundle::new(vec![
            issuer.ca.cert_der().to_vec(),
            second_root.clone(),
        ]));
        rx.changed().await.unwrap();
        let updated = ready(&rx);
        assert_eq!(updated.serial_hex, first.serial_hex, "same certificate");
        assert_eq!(
            updated.roots.der,
            vec![issuer.ca.cert_der().to_vec(), second_root],
            "the answer's root once, then the file's new one"
        );
        assert_eq!(
            meshca_certs::bundle::parse_certs_pem(&updated.roots.pem)
                .unwrap()
                .len(),
            2
        );
        // The same bundle again is not a change.
        bundle.send_modify(|_| {});
        assert!(
            tokio::time::timeout(Duration::from_secs(1), rx.changed())
                .await
                .is_err(),
            "no update for an unchanged bundle"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_roots_are_served_before_any_certificate() {
        let (issuer, feeds, _bundle) = setup(Duration::from_secs(100));
        issuer.hang.store(true, Ordering::SeqCst);
        let feed = feeds.get(&id("web"));
        let state = feed.state().borrow().clone();
        assert!(matches!(state.svid, SvidState::Pending { .. }));
        assert_eq!(state.roots.der, vec![issuer.ca.cert_der().to_vec()]);
    }

    #[tokio::test(start_paused = true)]
    async fn an_expired_certificate_is_withdrawn_and_a_new_one_served() {
        let (issuer, feeds, _bundle) = setup(Duration::from_secs(100));
        let feed = feeds.get(&id("web"));
        let mut rx = feed.state();
        let first = next(&mut rx).await;
        // The CA goes away: renewals fail; the certificate expires.
        *issuer.fail.lock().unwrap() = Some(tonic::Code::Unavailable);
        let start = Instant::now();
        let expired = loop {
            rx.changed().await.unwrap();
            let svid = rx.borrow().svid.clone();
            if !matches!(svid, SvidState::Ready(_)) {
                break svid;
            }
        };
        let waited = Instant::now() - start;
        assert!(
            waited >= Duration::from_secs(99) && waited <= Duration::from_secs(101),
            "withdrawn at its notAfter: {waited:?}"
        );
        let status = expired.failure().expect("a status for the expired state");
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert!(status.message().contains("expired"), "{status:?}");
        assert_eq!(rx.borrow().roots, first.roots, "the roots are still served");
        // The CA is back: the next retry's certificate is served.
        *issuer.fail.lock().unwrap() = None;
        let second = next(&mut rx).await;
        assert_ne!(second.serial_hex, first.serial_hex);
    }

    #[tokio::test(start_paused = true)]
    async fn a_refusal_by_the_ca_is_published_and_retried() {
        let (issuer, feeds, _bundle) = setup(Duration::from_secs(100));
        *issuer.fail.lock().unwrap() = Some(tonic::Code::PermissionDenied);
        let feed = feeds.get(&id("web"));
        let mut rx = feed.state();
        let status = loop {
            if let Some(status) = rx.borrow_and_update().svid.failure() {
                break status;
            }
            rx.changed().await.unwrap();
        };
        assert_eq!(status.code(), tonic::Code::PermissionDenied);
        assert!(status.message().contains(id("web").as_str()), "{status:?}");
        // A transient failure is no refusal: still pending.
        *issuer.fail.lock().unwrap() = Some(tonic::Code::Unavailable);
        loop {
            rx.changed().await.unwrap();
            if let SvidState::Pending { last_error } = &rx.borrow().svid {
                assert!(last_error
                    .as_deref()
                    .is_some_and(|e| e.contains("Unavailable")));
                break;
            }
        }
        *issuer.fail.lock().unwrap() = None;
        next(&mut rx).await;
    }
}
