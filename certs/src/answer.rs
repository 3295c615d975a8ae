//! The shape of a CreateCertificate answer's `cert_chain`, written by the CA
//! and read by clients: `[leaf, intermediates…, roots]`.
//!
//! Every element but the last is one PEM certificate. The last element
//! holds **every root a client must trust now**, the root the chain is
//! anchored at first and then the others, as several PEM blocks in that one
//! string. This is what istiod answers, and it matters because Istio's
//! clients (ztunnel's `WorkloadCertificate::new`, istio-agent) take their
//! trust roots for workload traffic from that last element only: during a
//! root rotation it must carry both roots, or a workload that renewed
//! learns only one of them and cannot verify a peer whose leaf chains to
//! the other.
//!
//! ```
//! use meshca_certs::answer::{encode_tail, ChainAnswer};
//! use meshca_certs::bundle::encode_cert_pem;
//! use meshca_certs::profile::{self_signed_root, SubjectName, Validity};
//! use meshca_certs::{KeyAlgorithm, PrivateKey, TrustBundle};
//!
//! let now = time::OffsetDateTime::now_utc();
//! let cert = || -> Result<Vec<u8>, Box<dyn std::error::Error>> {
//!     let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256)?;
//!     let validity = Validity::backdated(now, time::Duration::days(1));
//!     let name = SubjectName { common_name: Some("example".into()), ..Default::default() };
//!     Ok(self_signed_root(&key, &name, validity)?.der)
//! };
//! let (leaf, old_root, new_root) = (cert()?, cert()?, cert()?);
//! // During a rotation: signed under the old root, both roots trusted.
//! let bundle = TrustBundle::new(vec![old_root.clone(), new_root.clone()]);
//! let mut cert_chain = vec![encode_cert_pem(&leaf)];
//! cert_chain.extend(encode_tail(&[], &old_root, &bundle));
//! assert_eq!(cert_chain.len(), 2);
//! let answer = ChainAnswer::parse(&cert_chain)?;
//! assert_eq!(answer.roots.roots(), &[old_root, new_root]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use crate::bundle::{encode_cert_pem, parse_certs_pem, BundleError};
use crate::verify::TrustBundle;

/// Why a `cert_chain` does not have the answer's shape.
#[derive(Debug, thiserror::Error)]
pub enum AnswerError {
    /// No elements at all.
    #[error("the certificate chain is empty")]
    Empty,
    /// One element: the leaf without the roots element after it.
    #[error(
        "the certificate chain has only the leaf: the last element must hold the roots to trust"
    )]
    NoRoots,
    /// An element is not PEM certificates.
    #[error("chain element #{index}: {cause}")]
    Element {
        /// 1-based position of the element.
        index: usize,
        /// What is wrong with it.
        cause: BundleError,
    },
    /// The leaf's element holds more than one certificate.
    #[error("chain element #1 holds {count} certificates; it must be the leaf alone")]
    LeafNotAlone {
        /// How many it holds.
        count: usize,
    },
}

/// The elements after the leaf, PEM: one per certificate of `chain` (the
/// signing certificate and intermediates above it, without roots), then one
/// element with every root of `bundle`, `anchor` first.
///
/// The CA calls this once per CA material, not per request.
pub fn encode_tail(chain: &[Vec<u8>], anchor: &[u8], bundle: &TrustBundle) -> Vec<String> {
    chain
        .iter()
        .map(|der| encode_cert_pem(der))
        .chain(std::iter::once(roots_element(anchor, bundle)))
        .collect()
}

/// The last element of an answer: `anchor`, then every other root of
/// `bundle` in its order, as one PEM text.
pub(crate) fn roots_element(anchor: &[u8], bundle: &TrustBundle) -> String {
    std::iter::once(anchor)
        .chain(
            bundle
                .roots()
                .iter()
                .map(Vec::as_slice)
                .filter(|root| *root != anchor),
        )
        .map(encode_cert_pem)
        .collect()
}

/// An answer's `cert_chain`, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainAnswer {
    /// The leaf, DER.
    pub leaf: Vec<u8>,
    /// The certificates between the leaf and the roots element, DER.
    pub intermediates: Vec<Vec<u8>>,
    /// Every root of the last element, in order.
    pub roots: TrustBundle,
}

impl ChainAnswer {
    /// Parses `cert_chain`: at least two elements, the first the leaf
    /// alone, the last one or more roots. An element between them may hold
    /// several certificates (istiod puts a plugged-in CA's whole chain in
    /// one); they are all intermediates.
    pub fn parse(chain_pem: &[String]) -> Result<Self, AnswerError> {
        let (last, rest) = chain_pem.split_last().ok_or(AnswerError::Empty)?;
        if rest.is_empty() {
            return Err(AnswerError::NoRoots);
        }
        let element = |index: usize, pem: &str| {
            parse_certs_pem(pem).map_err(|cause| AnswerError::Element {
                index: index + 1,
                cause,
            })
        };
        let mut leaf = element(0, &rest[0])?;
        if leaf.len() != 1 {
            return Err(AnswerError::LeafNotAlone { count: leaf.len() });
        }
        let mut intermediates = Vec::new();
        for (i, pem) in rest.iter().enumerate().skip(1) {
            intermediates.extend(element(i, pem)?);
        }
        let roots = TrustBundle::new(element(chain_pem.len() - 1, last)?);
        Ok(Self {
            leaf: leaf.remove(0),
            intermediates,
            roots,
        })
    }

    /// Leaf and intermediates, DER: what a workload presents in a handshake.
    pub fn presented_chain(&self) -> Vec<Vec<u8>> {
        std::iter::once(self.leaf.clone())
            .chain(self.intermediates.iter().cloned())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::{KeyAlgorithm, PrivateKey};
    use crate::profile::{self_signed_root, SubjectName, Validity};

    fn root(cn: &str) -> Vec<u8> {
        let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let name = SubjectName {
            common_name: Some(cn.into()),
            ..Default::default()
        };
        let v = Validity::backdated(time::OffsetDateTime::now_utc(), time::Duration::days(1));
        self_signed_root(&key, &name, v).unwrap().der
    }

    #[test]
    fn the_roots_element_holds_every_root_anchor_first() {
        let (a, b, c) = (root("a"), root("b"), root("c"));
        let bundle = TrustBundle::new(vec![a.clone(), b.clone()]);
        // Anchored at b: b first, then a; one element for c (an
        // intermediate standing in), one for the roots.
        let tail = encode_tail(std::slice::from_ref(&c), &b, &bundle);
        assert_eq!(tail.len(), 2);
        assert_eq!(parse_certs_pem(&tail[0]).unwrap(), vec![c.clone()]);
        assert_eq!(
            parse_certs_pem(&tail[1]).unwrap(),
            vec![b.clone(), a.clone()]
        );
        // One root: one block.
        let one = TrustBundle::new(vec![a.clone()]);
        assert_eq!(parse_certs_pem(&roots_element(&a, &one)).unwrap(), vec![a]);
    }

    #[test]
    fn parse_splits_leaf_intermediates_and_roots() {
        let (leaf, int, a, b) = (root("leaf"), root("int"), root("a"), root("b"));
        let pem = encode_cert_pem;
        let chain = vec![pem(&leaf), pem(&int), format!("{}{}", pem(&a), pem(&b))];
        let answer = ChainAnswer::parse(&chain).unwrap();
        assert_eq!(answer.leaf, leaf);
        assert_eq!(answer.intermediates, vec![int.clone()]);
        assert_eq!(answer.roots.roots(), &[a.clone(), b]);
        assert_eq!(answer.presented_chain(), vec![leaf.clone(), int]);

        assert!(matches!(ChainAnswer::parse(&[]), Err(AnswerError::Empty)));
        assert!(matches!(
            ChainAnswer::parse(&[pem(&leaf)]),
            Err(AnswerError::NoRoots)
        ));
        let two_leaves = vec![format!("{}{}", pem(&leaf), pem(&a)), pem(&a)];
        assert!(matches!(
            ChainAnswer::parse(&two_leaves),
            Err(AnswerError::LeafNotAlone { count: 2 })
        ));
        let err = ChainAnswer::parse(&[pem(&leaf), "junk".into()]).unwrap_err();
        assert!(err.to_string().contains("chain element #2"), "{err}");
    }
}
