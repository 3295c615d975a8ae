//! [`Feeds`]: one [`Feed`] per identity that some stream watches, on top of
//! the [`CertManager`] (one renewal loop per identity, however many streams
//! watch it) and the watched `--root-cert` bundle.
//!
//! A feed turns the manager's certificate and the file's bundle into
//! [`Credentials`], once per change, for every stream of that identity.
//! When the last stream of an identity closes its feed is dropped, its task
//! ends and the identity leaves the manager (unless it is pinned, as the
//! configured identity of pod mode is).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use meshca_certs::{SpiffeId, TrustBundle};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::credentials::Credentials;
use crate::manager::{CertManager, CertState};

/// The credentials of one identity as they change; `None` until the first
/// certificate has arrived.
pub(crate) type CredentialsWatch = watch::Receiver<Option<Arc<Credentials>>>;

/// The live feeds, by identity.
#[derive(Debug)]
pub struct Feeds {
    manager: Arc<CertManager>,
    bundle: watch::Receiver<TrustBundle>,
    live: Mutex<HashMap<SpiffeId, Weak<Feed>>>,
}

/// One identity's credentials for the streams that hold it.
#[derive(Debug)]
pub struct Feed {
    identity: SpiffeId,
    credentials: CredentialsWatch,
    task: JoinHandle<()>,
    feeds: Arc<Feeds>,
}

impl Feeds {
    /// Feeds over `manager`, trusting also the roots `bundle` holds.
    pub fn new(manager: Arc<CertManager>, bundle: watch::Receiver<TrustBundle>) -> Arc<Self> {
        Arc::new(Self {
            manager,
            bundle,
            live: Mutex::new(HashMap::new()),
        })
    }

    /// The feed of `identity`, started (and the identity added to the
    /// manager) if no stream holds it yet.
    pub fn get(self: &Arc<Self>, identity: &SpiffeId) -> Arc<Feed> {
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(feed) = live.get(identity).and_then(Weak::upgrade) {
            return feed;
        }
        let certificates = self.manager.add(identity.clone());
        let (tx, credentials) = watch::channel(None);
        let task = tokio::spawn(follow(certificates, self.bundle.clone(), tx));
        let feed = Arc::new(Feed {
            identity: identity.clone(),
            credentials,
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

    /// A receiver of the identity's credentials.
    pub(crate) fn credentials(&self) -> CredentialsWatch {
        self.credentials.clone()
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

/// Publishes the credentials of the manager's certificate with the file's
/// bundle, whenever either changes, until every receiver is gone or the
/// manager drops the identity.
async fn follow(
    mut certificates: watch::Receiver<CertState>,
    mut bundle: watch::Receiver<TrustBundle>,
    tx: watch::Sender<Option<Arc<Credentials>>>,
) {
    let mut bundle_open = true;
    loop {
        let state = certificates.borrow_and_update().clone();
        let file_bundle = bundle.borrow_and_update().clone();
        if let CertState::Available(svid) = state {
            let fresh = Credentials::new(&svid, &file_bundle);
            tx.send_if_modified(|current| match current {
                Some(old) if !fresh.differs_from(old) => false,
                _ => {
                    *current = Some(fresh);
                    true
                }
            });
        }
        tokio::select! {
            changed = certificates.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            changed = bundle.changed(), if bundle_open => {
                bundle_open = changed.is_ok();
            }
            _ = tx.closed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::issuer::{CertificateIssuer, ClientError, Svid};
    use crate::manager::ManagerConfig;
    use meshca_certs::profile::{self_signed_root, SigningCa, SubjectKey, SubjectName, Validity};
    use meshca_certs::{KeyAlgorithm, PrivateKey};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;
    use time::OffsetDateTime;

    /// Issues real certificates of a given lifetime from a test CA.
    struct TestIssuer {
        ca: SigningCa,
        lifetime: Duration,
        calls: AtomicUsize,
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

    fn id(name: &str) -> SpiffeId {
        SpiffeId::parse(&format!("spiffe://cluster.local/ns/test/sa/{name}")).unwrap()
    }

    fn setup(lifetime: Duration) -> (Arc<TestIssuer>, Arc<Feeds>, watch::Sender<TrustBundle>) {
        let issuer = Arc::new(TestIssuer {
            ca: test_ca("root"),
            lifetime,
            calls: AtomicUsize::new(0),
        });
        let manager = Arc::new(CertManager::new(
            issuer.clone(),
            ManagerConfig {
                renew_jitter: 0.0,
                ..ManagerConfig::default()
            },
        ));
        let (bundle_tx, bundle_rx) = watch::channel(TrustBundle::default());
        (issuer, Feeds::new(manager, bundle_rx), bundle_tx)
    }

    async fn next(rx: &mut CredentialsWatch) -> Arc<Credentials> {
        loop {
            if let Some(c) = rx.borrow_and_update().clone() {
                return c;
            }
            rx.changed().await.unwrap();
        }
    }

    #[tokio::test(start_paused = true)]
    async fn one_renewal_loop_per_identity_and_released_with_the_last_stream() {
        let (issuer, feeds, _bundle) = setup(Duration::from_secs(100));
        let streams: Vec<Arc<Feed>> = (0..50).map(|_| feeds.get(&id("web"))).collect();
        let mut rx = streams[0].credentials();
        let first = next(&mut rx).await;
        assert_eq!(first.spiffe_id, id("web"));
        assert_eq!(first.roots_der.len(), 1, "the answer's root");
        assert_eq!(
            issuer.calls.load(Ordering::SeqCst),
            1,
            "one fetch for 50 streams"
        );
        assert_eq!(feeds.len(), 1);
        // A rotation reaches every stream.
        rx.changed().await.unwrap();
        let second = rx.borrow().clone().unwrap();
        assert_ne!(second.serial_hex, first.serial_hex);
        assert_eq!(issuer.calls.load(Ordering::SeqCst), 2);
        for feed in &streams {
            let c = feed.credentials().borrow().clone().unwrap();
            assert_eq!(c.serial_hex, second.serial_hex);
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
    async fn a_bundle_change_is_published_without_a_new_certificate() {
        let (issuer, feeds, bundle) = setup(Duration::from_secs(3600));
        let feed = feeds.get(&id("web"));
        let mut rx = feed.credentials();
        let first = next(&mut rx).await;
        let second_root = test_ca("second root").cert_der().to_vec();
        bundle.send_replace(TrustBundle::new(vec![
            issuer.ca.cert_der().to_vec(),
            second_root.clone(),
        ]));
        rx.changed().await.unwrap();
        let updated = rx.borrow().clone().unwrap();
        assert_eq!(updated.serial_hex, first.serial_hex, "same certificate");
        assert_eq!(
            updated.roots_der,
            vec![issuer.ca.cert_der().to_vec(), second_root],
            "the answer's root once, then the file's new one"
        );
        assert_eq!(
            meshca_certs::bundle::parse_certs_pem(&updated.roots_pem)
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
}
