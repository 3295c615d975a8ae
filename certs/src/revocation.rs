//! The revocation list an operator keeps: which serials, SPIFFE IDs,
//! service accounts, nodes and intermediates meshca no longer stands
//! behind.
//!
//! One list, two homes: the file [`REVOCATIONS_FILE`] in the CA's data
//! directory, and the key [`CONFIGMAP_KEY`] of the ConfigMap
//! [`CONFIGMAP_NAME`] in meshca's namespace. Both hold the same YAML:
//!
//! ```yaml
//! revocations:
//! - {"spiffe_id": "spiffe://cluster.local/ns/default/sa/web", "reason": "keyCompromise", "revoked_at": "2026-12-03T15:40:00Z"}
//! - serial: 3f0a1b…
//!   reason: superseded
//!   revoked_at: 2026-12-03T15:41:00Z
//!   expires: 2026-12-10T00:00:00Z
//! ```
//!
//! Each entry names exactly one target (`serial`, `spiffe_id`,
//! `service_account` as `NS/SA`, `node`, or `intermediate`), a `reason`
//! (RFC 5280's CRLReason names, default `unspecified`), the time it was
//! revoked, and optionally when the entry stops applying to new
//! certificates. [`RevocationList::parse`] reads the document entry by
//! entry: a malformed entry (edited by hand) is kept aside as a
//! [`RejectedEntry`] naming its place and never stops the others. Only a
//! document that is not YAML, or has no `revocations` list, is refused as a
//! whole ([`RevocationError`]); a reader then keeps its last good list.
//!
//! [`RevocationList::to_yaml`] writes one line per entry (a JSON object,
//! which is YAML's flow style), about 110 bytes for a serial: 9,000 serial
//! entries fit a ConfigMap's 1 MiB (the file has no such bound).

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::spiffe::SpiffeId;

/// The file name of the list in a data directory.
pub const REVOCATIONS_FILE: &str = "revocations.yaml";
/// The ConfigMap holding the list in meshca's namespace.
pub const CONFIGMAP_NAME: &str = "meshca-revocations";
/// The ConfigMap's key holding the list.
pub const CONFIGMAP_KEY: &str = "revocations.yaml";
/// The most entries one list may hold; entries beyond it are rejected
/// (each named), so a runaway script cannot make the CA's memory grow
/// without bound.
pub const MAX_REVOCATIONS: usize = 100_000;
/// The largest list document read (file or ConfigMap value), in bytes.
pub const MAX_DOCUMENT_BYTES: usize = 32 * 1024 * 1024;
/// The longest text kept of a rejected entry's error.
const MAX_ERROR_CHARS: usize = 300;

/// Why a whole revocation document was refused.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RevocationError {
    /// The document is larger than [`MAX_DOCUMENT_BYTES`].
    #[error("{source_name} is {size} bytes, more than the {MAX_DOCUMENT_BYTES} a revocation list may have")]
    TooLarge {
        /// Where the document came from.
        source_name: String,
        /// Its size.
        size: usize,
    },
    /// The document is not YAML, or has no `revocations` list.
    #[error("{source_name} is not a revocation list: {reason}")]
    Document {
        /// Where the document came from.
        source_name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Reading or writing the file failed.
    #[error("{path}: {reason}")]
    Io {
        /// The file.
        path: String,
        /// The operating system's error.
        reason: String,
    },
    /// A target or option given to build an entry is not valid.
    #[error("{0}")]
    InvalidEntry(String),
}

/// A certificate serial number, normalised: lowercase hex without colons
/// or leading zeros (`0` for zero), as `openssl` and meshca's logs show it
/// once their leading zeros are dropped.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Serial(String);

impl Serial {
    /// Parses hex, with or without `:` between bytes and an optional `0x`.
    pub fn parse(text: &str) -> Result<Self, RevocationError> {
        // The common case (meshca's own lowercase hex): one allocation.
        if !text.is_empty()
            && text.len() <= 80
            && text
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            let digits = text.trim_start_matches('0');
            return Ok(Self(if digits.is_empty() {
                "0".into()
            } else {
                digits.into()
            }));
        }
        let trimmed = text.trim();
        let body = trimmed
            .strip_prefix("0x")
            .or_else(|| trimmed.strip_prefix("0X"))
            .unwrap_or(trimmed);
        let digits: String = body.chars().filter(|c| *c != ':').collect();
        if digits.is_empty() || digits.len() > 80 || !digits.chars().all(|c| c.is_ascii_hexdigit())
        {
            return Err(RevocationError::InvalidEntry(format!(
                "serial {:?} is not hex (at most 40 bytes, e.g. 3f0a1b or 3f:0a:1b)",
                crate::untrusted_text::shortened(text, 100)
            )));
        }
        Ok(Self::normalise(&digits))
    }

    /// The serial of big-endian bytes (a certificate's INTEGER contents).
    pub fn from_bytes(bytes: &[u8]) -> Self {
        Self::normalise(&crate::profile::hex(bytes))
    }

    fn normalise(hex: &str) -> Self {
        let lower = hex.to_ascii_lowercase();
        let trimmed = lower.trim_start_matches('0');
        Self(if trimmed.is_empty() {
            "0".into()
        } else {
            trimmed.into()
        })
    }

    /// The normalised hex.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The big-endian bytes, without a sign byte.
    pub fn to_bytes(&self) -> Vec<u8> {
        let padded = if self.0.len() % 2 == 1 {
            format!("0{}", self.0)
        } else {
            self.0.clone()
        };
        padded
            .as_bytes()
            .chunks(2)
            .map(|pair| {
                let digit = |c: u8| (c as char).to_digit(16).unwrap_or(0) as u8;
                (digit(pair[0]) << 4) | digit(pair[1])
            })
            .collect()
    }
}

impl fmt::Display for Serial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// RFC 5280's CRLReason (section 5.3.1), as written in the list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum RevocationReason {
    /// No reason given (code 0).
    #[default]
    Unspecified,
    /// The key was compromised (1).
    KeyCompromise,
    /// The CA's key was compromised (2).
    CaCompromise,
    /// The subject's affiliation changed (3).
    AffiliationChanged,
    /// Replaced by another certificate (4).
    Superseded,
    /// No longer needed (5).
    CessationOfOperation,
    /// Privileges withdrawn (9).
    PrivilegeWithdrawn,
}

impl RevocationReason {
    /// Every reason, in code order.
    pub const ALL: [Self; 7] = [
        Self::Unspecified,
        Self::KeyCompromise,
        Self::CaCompromise,
        Self::AffiliationChanged,
        Self::Superseded,
        Self::CessationOfOperation,
        Self::PrivilegeWithdrawn,
    ];

    /// The name written in the list (RFC 5280's, e.g. `keyCompromise`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Unspecified => "unspecified",
            Self::KeyCompromise => "keyCompromise",
            Self::CaCompromise => "cACompromise",
            Self::AffiliationChanged => "affiliationChanged",
            Self::Superseded => "superseded",
            Self::CessationOfOperation => "cessationOfOperation",
            Self::PrivilegeWithdrawn => "privilegeWithdrawn",
        }
    }

    /// Parses a name, ignoring case, `-` and `_` (`key-compromise`,
    /// `keyCompromise`, `KEY_COMPROMISE`).
    pub fn parse(text: &str) -> Result<Self, RevocationError> {
        let squash = |s: &str| {
            s.chars()
                .filter(|c| *c != '-' && *c != '_')
                .collect::<String>()
                .to_ascii_lowercase()
        };
        let wanted = squash(text);
        Self::ALL
            .into_iter()
            .find(|r| squash(r.name()) == wanted)
            .ok_or_else(|| {
                RevocationError::InvalidEntry(format!(
                    "unknown reason {:?}: one of {}",
                    crate::untrusted_text::shortened(text, 60),
                    Self::ALL.map(Self::name).join(", ")
                ))
            })
    }
}

impl fmt::Display for RevocationReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An intermediate CA certificate, named by what identifies it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct IntermediateRef {
    /// Its subjectKeyIdentifier (lowercase hex): what its leaves' AKI names.
    pub key_id: String,
    /// Its serial.
    pub serial: String,
    /// Its subject, for people.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub subject: String,
}

impl IntermediateRef {
    /// Identifies the CA certificate in `pem` (the first certificate).
    pub fn from_pem(pem: &str) -> Result<Self, RevocationError> {
        let certs = crate::bundle::parse_certs_pem(pem)
            .map_err(|e| RevocationError::InvalidEntry(e.to_string()))?;
        let der = certs
            .first()
            .ok_or_else(|| RevocationError::InvalidEntry("the file holds no certificate".into()))?;
        Self::from_der(der)
    }

    /// Identifies the CA certificate `der`.
    pub fn from_der(der: &[u8]) -> Result<Self, RevocationError> {
        use x509_parser::prelude::{FromDer, ParsedExtension, X509Certificate};
        let (_, cert) = X509Certificate::from_der(der)
            .map_err(|e| RevocationError::InvalidEntry(format!("not a certificate: {e}")))?;
        if !cert.is_ca() {
            return Err(RevocationError::InvalidEntry(
                "the certificate is not a CA (basicConstraints cA is not true)".into(),
            ));
        }
        let key_id = cert
            .extensions()
            .iter()
            .find_map(|ext| match ext.parsed_extension() {
                ParsedExtension::SubjectKeyIdentifier(ski) => Some(crate::profile::hex(ski.0)),
                _ => None,
            })
            .ok_or_else(|| {
                RevocationError::InvalidEntry(
                    "the CA certificate has no subjectKeyIdentifier".into(),
                )
            })?;
        Ok(Self {
            key_id,
            serial: Serial::from_bytes(cert.raw_serial()).0,
            subject: cert.subject().to_string(),
        })
    }
}

/// What one entry revokes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum RevocationTarget {
    /// One certificate.
    Serial(Serial),
    /// Every certificate of a SPIFFE ID.
    SpiffeId(SpiffeId),
    /// Every certificate of a Kubernetes service account (any trust domain
    /// meshca signs for).
    ServiceAccount {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
    },
    /// Every certificate issued for pods of a node, node agents included.
    Node(String),
    /// An intermediate CA, and so every leaf under it.
    Intermediate(IntermediateRef),
}

impl RevocationTarget {
    /// Parses `NS/SA`.
    pub fn service_account(text: &str) -> Result<Self, RevocationError> {
        let valid = |s: &str| {
            !s.is_empty()
                && s.len() <= 253
                && s.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        };
        match text.trim().split_once('/') {
            Some((ns, sa)) if valid(ns) && valid(sa) => Ok(Self::ServiceAccount {
                namespace: ns.into(),
                name: sa.into(),
            }),
            _ => Err(RevocationError::InvalidEntry(format!(
                "service account {:?} is not NAMESPACE/NAME (lowercase letters, digits, '-' and '.')",
                crate::untrusted_text::shortened(text, 100)
            ))),
        }
    }

    /// Parses a node name (a Kubernetes object name).
    pub fn node(text: &str) -> Result<Self, RevocationError> {
        let text = text.trim();
        let valid = !text.is_empty()
            && text.len() <= 253
            && text
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.');
        if valid {
            Ok(Self::Node(text.into()))
        } else {
            Err(RevocationError::InvalidEntry(format!(
                "node {:?} is not a node name (lowercase letters, digits, '-' and '.')",
                crate::untrusted_text::shortened(text, 100)
            )))
        }
    }

    /// Parses a SPIFFE ID.
    pub fn spiffe_id(text: &str) -> Result<Self, RevocationError> {
        SpiffeId::parse(text.trim())
            .map(Self::SpiffeId)
            .map_err(|e| RevocationError::InvalidEntry(format!("spiffe_id: {e}")))
    }
}

impl fmt::Display for RevocationTarget {
    /// How the target is named in messages: `serial 3f0a…`,
    /// `spiffe-id spiffe://…`, `service-account ns/sa`, `node n`,
    /// `intermediate KEYID`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Serial(s) => write!(f, "serial {s}"),
            Self::SpiffeId(id) => write!(f, "spiffe-id {id}"),
            Self::ServiceAccount { namespace, name } => {
                write!(f, "service-account {namespace}/{name}")
            }
            Self::Node(n) => write!(f, "node {n}"),
            Self::Intermediate(i) => write!(f, "intermediate {}", i.key_id),
        }
    }
}

/// One entry of the list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Revocation {
    /// What it revokes.
    pub target: RevocationTarget,
    /// Why (kept out of answers to callers: it may be internal).
    pub reason: RevocationReason,
    /// When it was revoked.
    pub revoked_at: OffsetDateTime,
    /// After this, the entry no longer refuses new certificates (what it
    /// revoked before stays in the CRL until it expires).
    pub expires: Option<OffsetDateTime>,
}

impl Revocation {
    /// A new entry revoked now.
    pub fn new(target: RevocationTarget, reason: RevocationReason, now: OffsetDateTime) -> Self {
        Self {
            target,
            reason,
            revoked_at: now.replace_nanosecond(0).unwrap_or(now),
            expires: None,
        }
    }

    /// Whether the entry refuses new certificates at `now`.
    pub fn is_active(&self, now: OffsetDateTime) -> bool {
        self.expires.is_none_or(|e| now < e)
    }

    /// The entry's name in answers and logs: its target and when it was
    /// revoked (never the reason).
    pub fn name(&self) -> String {
        format!(
            "{} (revoked at {})",
            self.target,
            crate::Rfc3339(self.revoked_at)
        )
    }
}

/// The wire form of an entry: every target optional, exactly one allowed.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEntry {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    serial: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    spiffe_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    service_account: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    node: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    intermediate: Option<IntermediateRef>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    revoked_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    expires: Option<String>,
}

fn parse_time(field: &str, text: &str) -> Result<OffsetDateTime, RevocationError> {
    OffsetDateTime::parse(text.trim(), &time::format_description::well_known::Rfc3339).map_err(
        |e| {
            RevocationError::InvalidEntry(format!(
                "{field} {:?} is not an RFC 3339 time (e.g. 2026-12-03T15:40:00Z): {e}",
                crate::untrusted_text::shortened(text, 60)
            ))
        },
    )
}

impl RawEntry {
    fn into_revocation(self) -> Result<Revocation, RevocationError> {
        let mut targets = Vec::new();
        match &self.serial {
            None => {}
            Some(serde_json::Value::String(s)) => {
                targets.push(RevocationTarget::Serial(Serial::parse(s)?))
            }
            Some(other) => {
                return Err(RevocationError::InvalidEntry(format!(
                "serial {} is not a string: quote it (\"…\") so its hex digits are read as written",
                crate::untrusted_text::shortened(&other.to_string(), 60)
            )))
            }
        }
        if let Some(s) = &self.spiffe_id {
            targets.push(RevocationTarget::spiffe_id(s)?);
        }
        if let Some(s) = &self.service_account {
            targets.push(RevocationTarget::service_account(s)?);
        }
        if let Some(s) = &self.node {
            targets.push(RevocationTarget::node(s)?);
        }
        if let Some(i) = &self.intermediate {
            let key_id: String = i
                .key_id
                .trim()
                .chars()
                .filter(|c| *c != ':')
                .collect::<String>()
                .to_ascii_lowercase();
            if key_id.is_empty()
                || key_id.len() > 128
                || !key_id.chars().all(|c| c.is_ascii_hexdigit())
            {
                return Err(RevocationError::InvalidEntry(
                    "intermediate.key_id is not hex (the CA's subjectKeyIdentifier)".into(),
                ));
            }
            targets.push(RevocationTarget::Intermediate(IntermediateRef {
                key_id,
                serial: Serial::parse(&i.serial)?.0,
                subject: i.subject.clone(),
            }));
        }
        let target = match targets.len() {
            1 => targets.remove(0),
            0 => return Err(RevocationError::InvalidEntry(
                "no target: give one of serial, spiffe_id, service_account, node, intermediate"
                    .into(),
            )),
            _ => return Err(RevocationError::InvalidEntry(
                "more than one target: an entry revokes one of serial, spiffe_id, service_account, node, intermediate".into(),
            )),
        };
        let reason = match &self.reason {
            Some(r) => RevocationReason::parse(r)?,
            None => RevocationReason::Unspecified,
        };
        let revoked_at = match &self.revoked_at {
            Some(t) => parse_time("revoked_at", t)?,
            None => {
                return Err(RevocationError::InvalidEntry(
                    "no revoked_at: every entry says when it was revoked (RFC 3339)".into(),
                ))
            }
        };
        let expires = self
            .expires
            .as_deref()
            .map(|t| parse_time("expires", t))
            .transpose()?;
        Ok(Revocation {
            target,
            reason,
            revoked_at,
            expires,
        })
    }

    fn from_revocation(r: &Revocation) -> Self {
        let mut raw = RawEntry {
            reason: Some(r.reason.name().into()),
            revoked_at: Some(crate::Rfc3339(r.revoked_at).to_string()),
            expires: r.expires.map(|e| crate::Rfc3339(e).to_string()),
            ..Default::default()
        };
        match &r.target {
            RevocationTarget::Serial(s) => raw.serial = Some(s.0.clone().into()),
            RevocationTarget::SpiffeId(id) => raw.spiffe_id = Some(id.to_string()),
            RevocationTarget::ServiceAccount { namespace, name } => {
                raw.service_account = Some(format!("{namespace}/{name}"))
            }
            RevocationTarget::Node(n) => raw.node = Some(n.clone()),
            RevocationTarget::Intermediate(i) => raw.intermediate = Some(i.clone()),
        }
        raw
    }
}

/// An entry of a document that could not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RejectedEntry {
    /// Its place in the list, from 1.
    pub index: usize,
    /// What is wrong with it.
    pub error: String,
    /// The entry as it was written: kept when the list is written back,
    /// so a tool's edit does not drop what a person wrote by hand.
    pub raw: serde_json::Value,
}

impl fmt::Display for RejectedEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "entry {}: {}", self.index, self.error)
    }
}

/// What a request for a certificate is checked against.
#[derive(Debug, Clone, Copy, Default)]
pub struct IssuanceQuery<'a> {
    /// The identity to be issued.
    pub identity: Option<&'a SpiffeId>,
    /// The serial of the certificate the caller presented (renewal).
    pub presented_serial: Option<&'a Serial>,
    /// The node of the pod the certificate is for, or of the node agent.
    pub node: Option<&'a str>,
    /// The node of the caller when it differs (a node agent's own node).
    pub caller_node: Option<&'a str>,
    /// The key identifier of the CA that would sign (lowercase hex).
    pub signing_key_id: Option<&'a str>,
}

/// The operator's list, parsed, with indexes for the checks at issuance.
#[derive(Debug, Clone, Default)]
pub struct RevocationList {
    entries: Vec<Revocation>,
    /// The place in the document of each entry (new ones: after the rest).
    positions: Vec<usize>,
    rejected: Vec<RejectedEntry>,
    by_target: HashMap<RevocationTarget, usize>,
    intermediates: HashMap<String, usize>,
}

impl PartialEq for RevocationList {
    fn eq(&self, other: &Self) -> bool {
        self.entries == other.entries && self.rejected == other.rejected
    }
}

impl RevocationList {
    /// An empty list.
    pub fn new() -> Self {
        Self::default()
    }

    /// Parses a document (`source_name` names it in errors: a file path
    /// or `configmap NS/meshca-revocations`). An empty document is an
    /// empty list. Malformed entries are returned in
    /// [`RevocationList::rejected`], the others used.
    pub fn parse(text: &str, source_name: &str) -> Result<Self, RevocationError> {
        if text.len() > MAX_DOCUMENT_BYTES {
            return Err(RevocationError::TooLarge {
                source_name: source_name.into(),
                size: text.len(),
            });
        }
        if text.trim().is_empty() {
            return Ok(Self::new());
        }
        let doc: serde_json::Value =
            serde_saphyr::from_str(text).map_err(|e| RevocationError::Document {
                source_name: source_name.into(),
                reason: cut(&e.to_string()),
            })?;
        let items = match &doc {
            serde_json::Value::Null => return Ok(Self::new()),
            serde_json::Value::Object(map) => match map.get("revocations") {
                None | Some(serde_json::Value::Null) => return Ok(Self::new()),
                Some(serde_json::Value::Array(items)) => items,
                Some(_) => {
                    return Err(RevocationError::Document {
                        source_name: source_name.into(),
                        reason: "`revocations` is not a list".into(),
                    })
                }
            },
            _ => {
                return Err(RevocationError::Document {
                    source_name: source_name.into(),
                    reason: "the document is not a mapping with a `revocations` list".into(),
                })
            }
        };
        let mut list = Self::new();
        for (i, item) in items.iter().enumerate() {
            let index = i + 1;
            if list.entries.len() >= MAX_REVOCATIONS {
                list.rejected.push(RejectedEntry {
                    index,
                    error: format!("beyond the {MAX_REVOCATIONS} entries a list may hold"),
                    raw: item.clone(),
                });
                continue;
            }
            let parsed = RawEntry::deserialize(item)
                .map_err(|e| RevocationError::InvalidEntry(e.to_string()))
                .and_then(RawEntry::into_revocation);
            match parsed {
                Ok(entry) => list.push_entry(entry, index),
                Err(e) => list.rejected.push(RejectedEntry {
                    index,
                    error: cut(&e.to_string()),
                    raw: item.clone(),
                }),
            }
        }
        Ok(list)
    }

    /// Reads the list from `path`; a missing file is an empty list.
    pub fn read_file(path: &Path) -> Result<Self, RevocationError> {
        match std::fs::read(path) {
            Ok(bytes) => {
                let text = String::from_utf8(bytes).map_err(|_| RevocationError::Document {
                    source_name: path.display().to_string(),
                    reason: "not UTF-8".into(),
                })?;
                Self::parse(&text, &path.display().to_string())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Self::new()),
            Err(e) => Err(RevocationError::Io {
                path: path.display().to_string(),
                reason: e.to_string(),
            }),
        }
    }

    /// Writes the list to `path` atomically (a temporary file renamed over
    /// it), mode 0644.
    pub fn write_file(&self, path: &Path) -> Result<(), RevocationError> {
        crate::bundle::write_file_atomic(path, self.to_yaml().as_bytes(), 0o644).map_err(|e| {
            RevocationError::Io {
                path: path.display().to_string(),
                reason: e.to_string(),
            }
        })
    }

    fn push_entry(&mut self, entry: Revocation, position: usize) {
        let index = self.entries.len();
        self.positions.push(position);
        match &entry.target {
            RevocationTarget::Intermediate(i) => {
                self.intermediates.entry(i.key_id.clone()).or_insert(index);
            }
            target => {
                // The first entry of a target wins; a later duplicate is kept
                // in the list (and the CRL) but not indexed.
                self.by_target.entry(target.clone()).or_insert(index);
            }
        }
        self.entries.push(entry);
    }

    /// Adds an entry. An entry of the same target already in the list is
    /// replaced when it no longer applies (expired), else kept: the
    /// answer says which (`false`: already revoked).
    pub fn add(&mut self, entry: Revocation, now: OffsetDateTime) -> Result<bool, RevocationError> {
        if let Some(existing) = self.entries.iter().find(|e| e.target == entry.target) {
            if existing.is_active(now) {
                return Ok(false);
            }
        }
        if self.entries.len() >= MAX_REVOCATIONS {
            return Err(RevocationError::InvalidEntry(format!(
                "the list holds {MAX_REVOCATIONS} entries, the most it may"
            )));
        }
        self.push_entry(entry, usize::MAX);
        Ok(true)
    }

    /// The usable entries, in the document's order.
    pub fn entries(&self) -> &[Revocation] {
        &self.entries
    }

    /// The entries that could not be used.
    pub fn rejected(&self) -> &[RejectedEntry] {
        &self.rejected
    }

    /// The document: a header and one line per entry.
    pub fn to_yaml(&self) -> String {
        let mut out = String::with_capacity(64 + self.entries.len() * 120);
        out.push_str("# meshca revocation list: edit with `meshca-certs revoke`, or by hand (README, \"Revoking an identity\")\n");
        if self.entries.is_empty() && self.rejected.is_empty() {
            out.push_str("revocations: []\n");
            return out;
        }
        // JSON is YAML's flow style; serialising plain values cannot fail.
        let mut lines: Vec<(usize, String)> = self
            .entries
            .iter()
            .zip(&self.positions)
            .map(|(e, p)| {
                let json = serde_json::to_string(&RawEntry::from_revocation(e));
                (*p, json.unwrap_or_default())
            })
            .chain(
                self.rejected
                    .iter()
                    .map(|r| (r.index, serde_json::to_string(&r.raw).unwrap_or_default())),
            )
            .collect();
        lines.sort_by_key(|(p, _)| *p);
        out.push_str("revocations:\n");
        for (_, line) in lines {
            out.push_str("- ");
            out.push_str(&line);
            out.push('\n');
        }
        out
    }

    /// The entries as JSON (for `meshca-certs revocations list --json`).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "revocations": self.entries.iter().map(|e| {
                let mut v = serde_json::to_value(RawEntry::from_revocation(e)).unwrap_or_default();
                if let serde_json::Value::Object(map) = &mut v {
                    map.insert("name".into(), e.name().into());
                }
                v
            }).collect::<Vec<_>>(),
            "rejected": self.rejected.iter().map(|r| serde_json::json!({"entry": r.index, "error": r.error})).collect::<Vec<_>>(),
        })
    }

    fn active(&self, target: &RevocationTarget, now: OffsetDateTime) -> Option<&Revocation> {
        let index = *self.by_target.get(target)?;
        let entry = self.entries.get(index)?;
        if entry.is_active(now) {
            return Some(entry);
        }
        // A later entry of the same target may still apply.
        self.entries
            .iter()
            .find(|e| &e.target == target && e.is_active(now))
    }

    /// The entry that refuses a certificate for `query` at `now`, if any:
    /// the presented serial, the identity, its service account, the node
    /// (the pod's or the caller's), or the signing CA.
    pub fn refusal(&self, query: &IssuanceQuery<'_>, now: OffsetDateTime) -> Option<&Revocation> {
        if self.entries.is_empty() {
            return None;
        }
        if let Some(serial) = query.presented_serial {
            if let Some(r) = self.active(&RevocationTarget::Serial(serial.clone()), now) {
                return Some(r);
            }
        }
        if let Some(identity) = query.identity {
            if let Some(r) = self.active(&RevocationTarget::SpiffeId(identity.clone()), now) {
                return Some(r);
            }
            if let Ok((ns, sa)) = identity.kubernetes_workload() {
                let target = RevocationTarget::ServiceAccount {
                    namespace: ns.into(),
                    name: sa.into(),
                };
                if let Some(r) = self.active(&target, now) {
                    return Some(r);
                }
            }
        }
        for node in [query.node, query.caller_node].into_iter().flatten() {
            if let Some(r) = self.active(&RevocationTarget::Node(node.into()), now) {
                return Some(r);
            }
        }
        if let Some(key_id) = query.signing_key_id {
            if let Some(entry) = self
                .intermediates
                .get(key_id)
                .and_then(|i| self.entries.get(*i))
                .filter(|e| e.is_active(now))
            {
                return Some(entry);
            }
        }
        None
    }

    /// The entry that revokes an issued certificate, if any: a certificate
    /// matches an entry of its serial, identity, service account, node or
    /// issuer that it was issued before the entry expired (or ever).
    pub fn covering(&self, issued: &IssuedSummary<'_>) -> Option<&Revocation> {
        if self.entries.is_empty() {
            return None;
        }
        let applies = |e: &&Revocation| e.expires.is_none_or(|x| issued.issued_at < x);
        let lookup = |target: RevocationTarget| {
            let index = *self.by_target.get(&target)?;
            self.entries.get(index).filter(applies).or_else(|| {
                self.entries
                    .iter()
                    .find(|e| e.target == target && applies(e))
            })
        };
        lookup(RevocationTarget::Serial(issued.serial.clone()))
            .or_else(|| lookup(RevocationTarget::SpiffeId(issued.identity.clone())))
            .or_else(|| {
                let (ns, sa) = issued.identity.kubernetes_workload().ok()?;
                lookup(RevocationTarget::ServiceAccount {
                    namespace: ns.into(),
                    name: sa.into(),
                })
            })
            .or_else(|| lookup(RevocationTarget::Node(issued.node?.into())))
            .or_else(|| {
                self.intermediates
                    .get(issued.issuer_key_id?)
                    .and_then(|i| self.entries.get(*i))
                    .filter(applies)
            })
    }

    /// Whether an entry revokes a CA (`intermediate`): only then does a
    /// certificate's chain above its issuer matter.
    pub fn has_intermediate_entries(&self) -> bool {
        !self.intermediates.is_empty()
    }

    /// The serial entries: certificates the list names directly.
    pub fn serials(&self) -> impl Iterator<Item = (&Serial, &Revocation)> {
        self.entries.iter().filter_map(|e| match &e.target {
            RevocationTarget::Serial(s) => Some((s, e)),
            _ => None,
        })
    }

    /// Targets of the list, for a quick "anything at identity level?" test.
    pub fn has_identity_entries(&self) -> bool {
        let serials: HashSet<_> = self.serials().map(|(s, _)| s).collect();
        self.entries.len() > serials.len()
    }
}

/// What the CA remembers of a certificate it issued, as checked by
/// [`RevocationList::covering`].
#[derive(Debug, Clone, Copy)]
pub struct IssuedSummary<'a> {
    /// Its serial.
    pub serial: &'a Serial,
    /// Its identity.
    pub identity: &'a SpiffeId,
    /// The node of the pod (or node agent) it was issued for, when known.
    pub node: Option<&'a str>,
    /// The signing CA's key identifier (lowercase hex).
    pub issuer_key_id: Option<&'a str>,
    /// When it was issued.
    pub issued_at: OffsetDateTime,
}

fn cut(text: &str) -> String {
    let mut out: String = text.chars().take(MAX_ERROR_CHARS).collect();
    if text.chars().count() > MAX_ERROR_CHARS {
        out.push('…');
    }
    out.replace('\n', " ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> OffsetDateTime {
        OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339).unwrap()
    }

    #[test]
    fn serials_are_normalised() {
        assert_eq!(Serial::parse("00:3F:0a").unwrap().as_str(), "3f0a");
        assert_eq!(Serial::parse("0x0003f0a").unwrap().as_str(), "3f0a");
        assert_eq!(Serial::parse("000").unwrap().as_str(), "0");
        assert_eq!(Serial::from_bytes(&[0, 0x3f, 0x0a]).as_str(), "3f0a");
        assert_eq!(Serial::parse("f0a").unwrap().to_bytes(), vec![0x0f, 0x0a]);
        for bad in ["", "xyz", "12 34", &"a".repeat(81)] {
            assert!(Serial::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn reasons_parse_loosely_and_print_as_rfc_5280() {
        assert_eq!(
            RevocationReason::parse("key-compromise").unwrap(),
            RevocationReason::KeyCompromise
        );
        assert_eq!(
            RevocationReason::parse("CA_COMPROMISE").unwrap().name(),
            "cACompromise"
        );
        let e = RevocationReason::parse("because").unwrap_err().to_string();
        assert!(e.contains("keyCompromise"), "{e}");
    }

    const DOC: &str = r#"
revocations:
- {"spiffe_id": "spiffe://cluster.local/ns/default/sa/web", "reason": "keyCompromise", "revoked_at": "2026-12-03T15:40:00Z"}
- serial: 00:3f:0a
  revoked_at: 2026-12-03T15:41:00Z
- service_account: NOT/valid
  revoked_at: 2026-12-03T15:41:00Z
- node: node-1
  reason: cessationOfOperation
  revoked_at: 2026-12-03T15:42:00Z
  expires: 2026-12-04T00:00:00Z
- node: node-2
- serial: "01"
  spiffe_id: spiffe://cluster.local/ns/a/sa/b
  revoked_at: 2026-12-03T15:41:00Z
- servce_account: default/db
  revoked_at: 2026-12-03T15:41:00Z
- "just text"
- service_account: default/db
  revoked_at: 2026-12-03T15:43:00Z
  reason: whatever
- service_account: default/db
  revoked_at: 2026-12-03T15:43:00Z
  reason: superseded
"#;

    #[test]
    fn a_malformed_entry_is_rejected_by_its_place_and_the_rest_used() {
        let list = RevocationList::parse(DOC, "revocations.yaml").unwrap();
        let targets: Vec<String> = list
            .entries()
            .iter()
            .map(|e| e.target.to_string())
            .collect();
        assert_eq!(
            targets,
            [
                "spiffe-id spiffe://cluster.local/ns/default/sa/web",
                "serial 3f0a",
                "node node-1",
                "service-account default/db"
            ]
        );
        let rejected: Vec<usize> = list.rejected().iter().map(|r| r.index).collect();
        assert_eq!(rejected, [3, 5, 6, 7, 8, 9], "{:?}", list.rejected());
        let messages: Vec<String> = list.rejected().iter().map(|r| r.to_string()).collect();
        assert!(messages[0].contains("NAMESPACE/NAME"), "{messages:?}");
        assert!(messages[1].contains("revoked_at"), "{messages:?}");
        assert!(messages[2].contains("more than one target"), "{messages:?}");
        assert!(messages[3].contains("servce_account"), "{messages:?}");
        assert!(messages[5].contains("unknown reason"), "{messages:?}");
    }

    #[test]
    fn whole_documents_that_are_not_lists_are_refused() {
        assert!(RevocationList::parse("", "f").unwrap().entries().is_empty());
        assert!(RevocationList::parse("revocations: []", "f")
            .unwrap()
            .entries()
            .is_empty());
        for bad in ["[1, 2]", "revocations: 3", "revocations: [", "\t- x: : :"] {
            let e = RevocationList::parse(bad, "configmap istio-system/meshca-revocations");
            assert!(
                matches!(e, Err(RevocationError::Document { ref source_name, .. }) if source_name.contains("configmap")),
                "{bad:?}: {e:?}"
            );
        }
    }

    #[test]
    fn the_written_document_reads_back_the_same() {
        let list = RevocationList::parse(DOC, "f").unwrap();
        let again = RevocationList::parse(&list.to_yaml(), "f").unwrap();
        assert_eq!(again.entries(), list.entries());
        // Rejected entries are written back as they were, in their places.
        assert_eq!(again.rejected(), list.rejected());
        // One line per entry, about 110 bytes: 9,000 fit a ConfigMap's 1 MiB.
        let mut big = RevocationList::new();
        for i in 0..9_000u32 {
            let serial = Serial::from_bytes(&[0x40; 17])
                .0
                .replace("4040", &format!("{i:04x}"));
            big.add(
                Revocation::new(
                    RevocationTarget::Serial(Serial::parse(&serial).unwrap()),
                    RevocationReason::KeyCompromise,
                    t("2026-12-03T15:40:00Z"),
                ),
                t("2026-12-03T15:40:00Z"),
            )
            .unwrap();
        }
        assert!(big.to_yaml().len() < 1_000_000, "{}", big.to_yaml().len());
    }

    #[test]
    fn refusal_names_the_entry_for_identity_service_account_node_and_serial() {
        let list = RevocationList::parse(DOC, "f").unwrap();
        let now = t("2026-12-03T16:00:00Z");
        let web = SpiffeId::parse("spiffe://cluster.local/ns/default/sa/web").unwrap();
        let db = SpiffeId::parse("spiffe://other.td/ns/default/sa/db").unwrap();
        let api = SpiffeId::parse("spiffe://cluster.local/ns/default/sa/api").unwrap();
        let q = |identity, serial, node| IssuanceQuery {
            identity: Some(identity),
            presented_serial: serial,
            node,
            ..Default::default()
        };
        let name = |r: Option<&Revocation>| r.map(|r| r.target.to_string());
        assert_eq!(
            name(list.refusal(&q(&web, None, None), now)).as_deref(),
            Some("spiffe-id spiffe://cluster.local/ns/default/sa/web")
        );
        assert_eq!(
            name(list.refusal(&q(&db, None, None), now)).as_deref(),
            Some("service-account default/db")
        );
        assert_eq!(list.refusal(&q(&api, None, None), now), None);
        let s = Serial::parse("3f0a").unwrap();
        assert_eq!(
            name(list.refusal(&q(&api, Some(&s), None), now)).as_deref(),
            Some("serial 3f0a")
        );
        assert_eq!(
            name(list.refusal(&q(&api, None, Some("node-1")), now)).as_deref(),
            Some("node node-1")
        );
        // node-1's entry expired: new certificates again, the old ones stay covered.
        let later = t("2026-12-05T00:00:00Z");
        assert_eq!(list.refusal(&q(&api, None, Some("node-1")), later), None);
        let old = IssuedSummary {
            serial: &Serial::parse("77").unwrap(),
            identity: &api,
            node: Some("node-1"),
            issuer_key_id: None,
            issued_at: t("2026-12-03T12:00:00Z"),
        };
        assert!(list.covering(&old).is_some());
        let new = IssuedSummary {
            issued_at: later,
            ..old
        };
        assert!(list.covering(&new).is_none());
        // The name carries the target and the time, never the reason.
        let r = list.refusal(&q(&web, None, None), now).unwrap();
        assert!(!r.name().contains("keyCompromise"), "{}", r.name());
    }

    #[test]
    fn adding_an_active_target_again_changes_nothing() {
        let now = t("2026-12-03T16:00:00Z");
        let mut list = RevocationList::new();
        let entry = Revocation::new(
            RevocationTarget::node("n1").unwrap(),
            RevocationReason::Unspecified,
            now,
        );
        assert!(list.add(entry.clone(), now).unwrap());
        assert!(!list.add(entry, now).unwrap());
        assert_eq!(list.entries().len(), 1);
    }
}
