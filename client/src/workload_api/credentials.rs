//! [`Credentials`]: what the socket serves for one identity at one moment,
//! in the encodings both APIs need, computed once per certificate or bundle
//! change and shared by every stream; [`Roots`]: the trust bundle alone,
//! which is known before any certificate.

use std::fmt;
use std::sync::Arc;

use meshca_certs::bundle::{encode_certs_pem, parse_certs_pem};
use meshca_certs::{SpiffeId, TrustBundle};
use time::OffsetDateTime;

use crate::issuer::{ClientError, Svid};

/// The CA's CRL as the agent serves it (`--crl-file`): the Workload API's
/// `crl` field and the SDS validation context's `crl`.
#[derive(Debug, PartialEq, Eq)]
pub struct ServedCrl {
    /// The CRL, DER.
    pub(crate) der: Vec<u8>,
    /// The CRL, PEM.
    pub(crate) pem: String,
    /// Its nextUpdate: not served after it.
    next_update: Option<OffsetDateTime>,
}

impl ServedCrl {
    /// Reads a PEM CRL (its signature is checked against the roots when it
    /// is served).
    pub fn from_pem(pem: &str) -> Result<Self, meshca_certs::crl::CrlError> {
        let parsed = meshca_certs::crl::ParsedCrl::from_pem(pem)?;
        Ok(Self {
            pem: meshca_certs::crl::encode_crl_pem(&parsed.der),
            next_update: parsed.next_update,
            der: parsed.der,
        })
    }

    /// Whether the CA that issued `svid` (one of its roots, or a CA
    /// certificate of its chain) signed this CRL and its nextUpdate is
    /// ahead at `now`: what `meshca-agent --out` checks before it writes
    /// `ca-crl.pem`.
    pub fn is_signed_for(&self, svid: &Svid, now: OffsetDateTime) -> bool {
        let mut issuers: Vec<Vec<u8>> = svid.bundle.roots().to_vec();
        let n = svid.chain_pem.len();
        for pem in svid.chain_pem.iter().take(n.saturating_sub(1)).skip(1) {
            issuers.extend(parse_certs_pem(pem).unwrap_or_default());
        }
        self.verifies_with(&issuers, now)
    }

    /// Refuses `svid` when this CRL lists a certificate of its chain (the
    /// leaf, or an intermediate of the answer): what [`crate::CaClient`]
    /// checks before a fetched chain is handed on (`CaClient::with_crl`).
    /// The CRL applies only while a CA of the chain (one of its roots, or an
    /// intermediate of the answer) signed it and its nextUpdate is ahead; a
    /// certificate is listed only by its own issuer's CRL. A CRL of another
    /// CA (an old one during a rotation) checks nothing.
    pub fn check_chain(&self, svid: &Svid, now: OffsetDateTime) -> Result<(), ClientError> {
        if !self.is_signed_for(svid, now) {
            tracing::debug!(identity = %svid.leaf.spiffe_id, "the CRL is not signed by a CA of this chain or is stale; not checked against it");
            return Ok(());
        }
        let Ok(parsed) = meshca_certs::crl::ParsedCrl::from_der(&self.der) else {
            return Ok(());
        };
        let n = svid.chain_pem.len();
        let certificates = svid
            .chain_pem
            .iter()
            .take(n.saturating_sub(1).max(1))
            .flat_map(|pem| parse_certs_pem(pem).unwrap_or_default());
        for (position, der) in certificates.enumerate() {
            if let Some(serial) = parsed.lists(&der) {
                return Err(ClientError::Revoked {
                    certificate: if position == 0 {
                        "leaf".into()
                    } else {
                        format!("intermediate {position}")
                    },
                    serial: serial.to_string(),
                });
            }
        }
        Ok(())
    }

    /// Whether its nextUpdate has passed at `now` (a stale CRL is not
    /// served).
    pub fn is_stale(&self, now: OffsetDateTime) -> bool {
        self.next_update.is_some_and(|n| n <= now)
    }

    /// The CRL, PEM.
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// Whether one of `issuers` (roots, or the CA certificates of the
    /// chain) signed it and its nextUpdate is still ahead: a CRL that does
    /// not verify, or is stale, is not served (a client would refuse
    /// every peer with it).
    fn verifies_with(&self, issuers: &[Vec<u8>], now: OffsetDateTime) -> bool {
        if self.is_stale(now) {
            return false;
        }
        let Ok(parsed) = meshca_certs::crl::ParsedCrl::from_der(&self.der) else {
            return false;
        };
        issuers.iter().any(|ca| parsed.verify(ca, now).is_ok())
    }
}

/// Every root to trust, DER and PEM, and the CA's CRL when one is given
/// and verifies.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Roots {
    /// Every trusted root, DER.
    pub(crate) der: Vec<Vec<u8>>,
    /// Every trusted root, PEM.
    pub(crate) pem: String,
    /// The CRL, checked against the roots and the answer's CA certificates.
    pub(crate) crl: Option<Arc<ServedCrl>>,
}

impl Roots {
    /// The roots in the last element of `svid`'s answer (during a root
    /// rotation it carries every root), if there is one, then those of
    /// `file_bundle` not already among them.
    pub(crate) fn new(
        svid: Option<&Svid>,
        file_bundle: &TrustBundle,
        crl: Option<&Arc<ServedCrl>>,
    ) -> Arc<Self> {
        let mut der: Vec<Vec<u8>> = svid
            .and_then(|svid| {
                let n = svid.chain_pem.len();
                (n > 1).then(|| parse_certs_pem(&svid.chain_pem[n - 1]).unwrap_or_default())
            })
            .unwrap_or_default();
        for root in file_bundle.roots() {
            if !der.contains(root) {
                der.push(root.clone());
            }
        }
        let crl = crl.filter(|crl| {
            // The signing CA is a root, or an intermediate of the answer.
            let mut issuers = der.clone();
            if let Some(svid) = svid {
                let n = svid.chain_pem.len();
                for pem in svid.chain_pem.iter().take(n.saturating_sub(1)).skip(1) {
                    issuers.extend(parse_certs_pem(pem).unwrap_or_default());
                }
            }
            let ok = crl.verifies_with(&issuers, OffsetDateTime::now_utc());
            if !ok {
                tracing::warn!(
                    "the CRL is not signed by a trusted CA or is past its nextUpdate; not served"
                );
            }
            ok
        });
        Arc::new(Self {
            pem: encode_certs_pem(&der),
            der,
            crl: crl.cloned(),
        })
    }

    /// Every root as one DER blob, as the Workload API sends a bundle.
    pub(crate) fn der_concat(&self) -> Vec<u8> {
        self.der.concat()
    }
}

/// One identity's certificate, key and trust bundle.
///
/// The trust bundle is every root the agent knows: the roots in the last
/// element of the CA's answer (during a root rotation it carries every root)
/// followed by those of the `--root-cert` file not already among them (a
/// rotated root published in the file arrives before the next renewal).
pub(crate) struct Credentials {
    /// The SPIFFE ID.
    pub(crate) spiffe_id: SpiffeId,
    /// The leaf's serial, hex.
    pub(crate) serial_hex: String,
    /// The leaf's notAfter.
    pub(crate) not_after: OffsetDateTime,
    /// Leaf then intermediates, DER, one certificate per element.
    pub(crate) chain_der: Vec<Vec<u8>>,
    /// Every trusted root.
    pub(crate) roots: Arc<Roots>,
    /// The leaf's key, PKCS#8 DER.
    key_pkcs8_der: Vec<u8>,
    /// Leaf then intermediates, PEM.
    pub(crate) chain_pem: String,
    /// The leaf's key, PKCS#8 PEM.
    key_pem: String,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("spiffe_id", &self.spiffe_id.as_str())
            .field("serial_hex", &self.serial_hex)
            .field("chain", &self.chain_der.len())
            .field("not_after", &self.not_after)
            .field("roots", &self.roots.der.len())
            .finish_non_exhaustive()
    }
}

impl Credentials {
    /// Builds the served form of `svid`, trusting its answer's roots and
    /// those of `file_bundle`.
    pub(crate) fn new(
        svid: &Svid,
        file_bundle: &TrustBundle,
        crl: Option<&Arc<ServedCrl>>,
    ) -> Arc<Self> {
        let n = svid.chain_pem.len();
        let chain_elements = if n > 1 {
            &svid.chain_pem[..n - 1]
        } else {
            &svid.chain_pem[..]
        };
        // The answer was parsed and verified when it arrived, so these
        // parse; an element that does not is skipped rather than served.
        let chain_der: Vec<Vec<u8>> = chain_elements
            .iter()
            .flat_map(|pem| parse_certs_pem(pem).unwrap_or_default())
            .collect();
        Arc::new(Self {
            spiffe_id: svid.leaf.spiffe_id.clone(),
            serial_hex: svid.leaf.serial_hex.clone(),
            not_after: svid.leaf.not_after,
            chain_pem: encode_certs_pem(&chain_der),
            roots: Roots::new(Some(svid), file_bundle, crl),
            key_pkcs8_der: svid.key.to_pkcs8_der(),
            key_pem: svid.key.to_pkcs8_pem(),
            chain_der,
        })
    }

    /// The leaf's key, PKCS#8 DER (the Workload API's `x509_svid_key`).
    pub(crate) fn key_pkcs8_der(&self) -> &[u8] {
        &self.key_pkcs8_der
    }

    /// The leaf's key, PKCS#8 PEM (SDS's `private_key`).
    pub(crate) fn key_pem(&self) -> &str {
        &self.key_pem
    }

    /// The chain as one DER blob (leaf first), as the Workload API sends it.
    pub(crate) fn chain_der_concat(&self) -> Vec<u8> {
        self.chain_der.concat()
    }

    /// Whether serving `self` after `other` is a change a client must see
    /// (a new certificate or a different bundle).
    pub(crate) fn differs_from(&self, other: &Self) -> bool {
        self.serial_hex != other.serial_hex
            || self.spiffe_id != other.spiffe_id
            || self.roots != other.roots
    }
}
