//! SPIFFE identities: [`TrustDomain`] and [`SpiffeId`], parsed and validated
//! by the rules of the SPIFFE-ID specification.
//!
//! - scheme `spiffe`, lowercase;
//! - trust domain of `[a-z0-9._-]`, non-empty, no port, no userinfo;
//! - path segments of `[A-Za-z0-9._-]`, none empty, `.` or `..`, no trailing `/`;
//! - no query, no fragment, no percent-encoding, at most 2048 bytes in all.

use std::fmt;
use std::str::FromStr;

/// Longest SPIFFE ID the spec allows, in bytes.
pub(crate) const MAX_SPIFFE_ID_LEN: usize = 2048;
/// Longest trust domain name, in bytes (the spec's DNS-name limit).
pub(crate) const MAX_TRUST_DOMAIN_LEN: usize = 255;
/// Trust domain used when none is configured, as in Istio.
pub const DEFAULT_TRUST_DOMAIN: &str = "cluster.local";

const SCHEME_PREFIX: &str = "spiffe://";

/// Why a string is not a valid SPIFFE ID or trust domain.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpiffeIdError {
    /// The ID does not start with `spiffe://`.
    #[error("a SPIFFE ID must start with \"spiffe://\"")]
    WrongScheme,
    /// The trust domain is empty.
    #[error("the trust domain is empty")]
    EmptyTrustDomain,
    /// The trust domain holds a character outside `[a-z0-9._-]`.
    #[error("the trust domain holds {0:?}: only lowercase letters, digits, '.', '-' and '_' are allowed (no port, userinfo or uppercase)")]
    BadTrustDomainChar(char),
    /// The trust domain is longer than the spec allows.
    #[error("the trust domain is {0} bytes, longer than the {MAX_TRUST_DOMAIN_LEN} allowed")]
    TrustDomainTooLong(usize),
    /// The path holds an empty segment (`//` or a trailing `/`).
    #[error("the path holds an empty segment (\"//\" or a trailing \"/\")")]
    EmptySegment,
    /// The path holds a `.` or `..` segment.
    #[error("the path holds a relative segment \".\" or \"..\"")]
    DotSegment,
    /// The path holds a character outside `[A-Za-z0-9._-]`.
    #[error("the path holds {0:?}: only letters, digits, '.', '-' and '_' are allowed in segments (no query, fragment or percent-encoding)")]
    BadPathChar(char),
    /// The whole ID is longer than 2048 bytes.
    #[error("the SPIFFE ID is {0} bytes, longer than the {MAX_SPIFFE_ID_LEN} allowed")]
    TooLong(usize),
    /// A Kubernetes workload ID was expected (`/ns/<ns>/sa/<sa>`).
    #[error(
        "not a Kubernetes workload identity: the path must be /ns/<namespace>/sa/<service-account>"
    )]
    NotKubernetesWorkload,
}

/// A SPIFFE trust domain, such as `cluster.local`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TrustDomain(String);

impl TrustDomain {
    /// Parses a trust domain name (without `spiffe://`).
    pub fn new(name: &str) -> Result<Self, SpiffeIdError> {
        validate_trust_domain(name)?;
        Ok(Self(name.to_string()))
    }

    /// The trust domain's name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The SPIFFE ID of the trust domain itself (`spiffe://<td>`).
    pub fn id_string(&self) -> String {
        format!("{SCHEME_PREFIX}{}", self.0)
    }
}

impl Default for TrustDomain {
    fn default() -> Self {
        Self(DEFAULT_TRUST_DOMAIN.to_string())
    }
}

impl fmt::Display for TrustDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for TrustDomain {
    type Err = SpiffeIdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

/// A validated SPIFFE ID, such as `spiffe://cluster.local/ns/default/sa/web`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SpiffeId {
    id: String,
    /// Byte offset where the path starts (== id.len() when there is no path).
    path_start: usize,
}

impl SpiffeId {
    /// Parses and validates a SPIFFE ID.
    pub fn parse(id: &str) -> Result<Self, SpiffeIdError> {
        if id.len() > MAX_SPIFFE_ID_LEN {
            return Err(SpiffeIdError::TooLong(id.len()));
        }
        let rest = id
            .strip_prefix(SCHEME_PREFIX)
            .ok_or(SpiffeIdError::WrongScheme)?;
        let (td, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        validate_trust_domain(td)?;
        validate_path(path)?;
        Ok(Self {
            id: id.to_string(),
            path_start: SCHEME_PREFIX.len() + td.len(),
        })
    }

    /// The SPIFFE ID of a Kubernetes workload:
    /// `spiffe://<td>/ns/<namespace>/sa/<service_account>`.
    pub fn for_workload(
        trust_domain: &TrustDomain,
        namespace: &str,
        service_account: &str,
    ) -> Result<Self, SpiffeIdError> {
        for segment in [namespace, service_account] {
            if segment.is_empty() {
                return Err(SpiffeIdError::EmptySegment);
            }
            if segment.contains('/') {
                return Err(SpiffeIdError::BadPathChar('/'));
            }
        }
        // Built by hand rather than with `format!`: once per token checked.
        let td = trust_domain.as_str();
        let mut id = String::with_capacity(
            SCHEME_PREFIX.len() + td.len() + 8 + namespace.len() + service_account.len(),
        );
        for part in [
            SCHEME_PREFIX,
            td,
            "/ns/",
            namespace,
            "/sa/",
            service_account,
        ] {
            id.push_str(part);
        }
        Self::parse(&id)
    }

    /// The trust domain name.
    pub fn trust_domain_name(&self) -> &str {
        &self.id[SCHEME_PREFIX.len()..self.path_start]
    }

    /// The trust domain.
    pub fn trust_domain(&self) -> TrustDomain {
        TrustDomain(self.trust_domain_name().to_string())
    }

    /// The path, with its leading `/` (empty for a trust domain ID).
    pub fn path(&self) -> &str {
        &self.id[self.path_start..]
    }

    /// The whole ID as a string.
    pub fn as_str(&self) -> &str {
        &self.id
    }

    /// For a Kubernetes workload ID (`/ns/<ns>/sa/<sa>`), its namespace and
    /// service account.
    pub fn kubernetes_workload(&self) -> Result<(&str, &str), SpiffeIdError> {
        let mut segments = self.path().split('/').skip(1);
        match (
            segments.next(),
            segments.next(),
            segments.next(),
            segments.next(),
            segments.next(),
        ) {
            (Some("ns"), Some(ns), Some("sa"), Some(sa), None) => Ok((ns, sa)),
            _ => Err(SpiffeIdError::NotKubernetesWorkload),
        }
    }
}

impl fmt::Display for SpiffeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.id)
    }
}

impl FromStr for SpiffeId {
    type Err = SpiffeIdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

fn validate_trust_domain(td: &str) -> Result<(), SpiffeIdError> {
    if td.is_empty() {
        return Err(SpiffeIdError::EmptyTrustDomain);
    }
    if td.len() > MAX_TRUST_DOMAIN_LEN {
        return Err(SpiffeIdError::TrustDomainTooLong(td.len()));
    }
    if let Some(c) = td
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '-' | '_')))
    {
        return Err(SpiffeIdError::BadTrustDomainChar(c));
    }
    Ok(())
}

fn validate_path(path: &str) -> Result<(), SpiffeIdError> {
    if path.is_empty() {
        return Ok(());
    }
    // The caller split at the first '/', so the path starts with one.
    for segment in path[1..].split('/') {
        match segment {
            "" => return Err(SpiffeIdError::EmptySegment),
            "." | ".." => return Err(SpiffeIdError::DotSegment),
            _ => {}
        }
        if let Some(c) = segment
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_')))
        {
            return Err(SpiffeIdError::BadPathChar(c));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_workload_ids() {
        let id = SpiffeId::parse("spiffe://cluster.local/ns/default/sa/web").unwrap();
        assert_eq!(id.trust_domain_name(), "cluster.local");
        assert_eq!(id.path(), "/ns/default/sa/web");
        assert_eq!(id.kubernetes_workload().unwrap(), ("default", "web"));
        let td = SpiffeId::parse("spiffe://example.org").unwrap();
        assert_eq!(td.path(), "");
        assert!(td.kubernetes_workload().is_err());
    }

    #[test]
    fn builds_workload_ids() {
        let id = SpiffeId::for_workload(&TrustDomain::default(), "ns1", "sa-1").unwrap();
        assert_eq!(id.as_str(), "spiffe://cluster.local/ns/ns1/sa/sa-1");
        assert!(SpiffeId::for_workload(&TrustDomain::default(), "a/b", "sa").is_err());
    }

    #[test]
    fn rejects_invalid_ids() {
        use SpiffeIdError::*;
        let cases = [
            ("http://cluster.local/ns/a", WrongScheme),
            ("SPIFFE://cluster.local/ns/a", WrongScheme),
            ("spiffe://", EmptyTrustDomain),
            ("spiffe:///ns/a", EmptyTrustDomain),
            ("spiffe://Cluster.local/ns/a", BadTrustDomainChar('C')),
            ("spiffe://cluster.local:8080/ns/a", BadTrustDomainChar(':')),
            ("spiffe://user@cluster.local/ns/a", BadTrustDomainChar('@')),
            ("spiffe://cluster.local/", EmptySegment),
            ("spiffe://cluster.local/ns//a", EmptySegment),
            ("spiffe://cluster.local/ns/a/", EmptySegment),
            ("spiffe://cluster.local/ns/./a", DotSegment),
            ("spiffe://cluster.local/ns/../a", DotSegment),
            ("spiffe://cluster.local/ns/a?x=1", BadPathChar('?')),
            ("spiffe://cluster.local/ns/a#frag", BadPathChar('#')),
            ("spiffe://cluster.local/ns/a%20b", BadPathChar('%')),
            ("spiffe://cluster.local/ns/ä", BadPathChar('ä')),
        ];
        for (input, want) in cases {
            assert_eq!(SpiffeId::parse(input), Err(want), "{input}");
        }
        let long = format!("spiffe://td/{}", "a".repeat(MAX_SPIFFE_ID_LEN));
        assert!(matches!(SpiffeId::parse(&long), Err(TooLong(_))));
    }

    #[test]
    fn trust_domain_rules() {
        assert!(TrustDomain::new("cluster.local").is_ok());
        assert!(TrustDomain::new("my_td-1.example").is_ok());
        assert!(TrustDomain::new("").is_err());
        assert!(TrustDomain::new("UPPER").is_err());
        assert!(TrustDomain::new(&"a".repeat(256)).is_err());
    }
}
