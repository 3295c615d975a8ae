//! The JWT-SVID signing keys: their own keys (never the X.509 CA key),
//! kept in the data directory (`jwt-svid-keys.json`, mode 0600), and
//! their rotation as a pure function of the key list and the time
//! ([`plan`]), so every phase is tested without waiting.
//!
//! The rotation, as SPIRE's server does it: a key signs for
//! `--jwt-key-rotation`; its successor is made and published in every
//! bundle [`RotationPolicy::announce`] (one `--max-jwt-svid-ttl`) before it
//! starts signing, so every relying party that refreshes its bundle at
//! the announced pace knows the key before the first token it signs; a
//! key that no longer signs stays in the bundle until the last token it
//! signed has expired (one maximum lifetime after its successor took
//! over, plus [`CLOCK_SKEW`]).

use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use base64::Engine as _;
use ring::rand::{SecureRandom, SystemRandom};
use ring::signature::{EcdsaKeyPair, KeyPair as _, RsaKeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};
use serde::{Deserialize, Serialize};

/// The file of the keys in the data directory.
pub(crate) const KEYS_FILE: &str = "jwt-svid-keys.json";

/// How long a retired key stays past the last expiry of the tokens it
/// signed, for relying parties whose clocks are behind (at most one
/// maximum token lifetime, so a rotation keeps at most three keys).
pub(crate) const CLOCK_SKEW: Duration = Duration::from_secs(60);

/// The most keys a key file may hold (a rotation keeps three: the one
/// whose tokens are still alive, the current one, the next one, since a
/// key signs at least two maximum lifetimes).
pub(crate) const MAX_KEYS: usize = 8;

/// Largest key file read (a few RSA keys fit many times over).
const MAX_KEYS_FILE_BYTES: u64 = 64 * 1024;

/// A JWT-SVID signature algorithm meshca signs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
pub enum JwtAlgorithm {
    /// ECDSA P-256 with SHA-256 (the default, as SPIRE's).
    #[serde(rename = "ES256")]
    #[value(name = "ES256", alias = "es256")]
    Es256,
    /// RSASSA-PKCS1-v1_5 with SHA-256 and a 2048-bit key (for relying
    /// parties that accept nothing else).
    #[serde(rename = "RS256")]
    #[value(name = "RS256", alias = "rs256")]
    Rs256,
}

impl JwtAlgorithm {
    /// Its JOSE name (`alg`).
    pub fn name(self) -> &'static str {
        match self {
            JwtAlgorithm::Es256 => "ES256",
            JwtAlgorithm::Rs256 => "RS256",
        }
    }
}

/// Why the keys could not be loaded, made or kept.
#[derive(Debug, thiserror::Error)]
pub enum JwtKeyError {
    /// The key file could not be read.
    #[error("reading the JWT-SVID keys {path}: {cause}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        cause: std::io::Error,
    },
    /// The key file is not what meshca writes.
    #[error("the JWT-SVID key file {path} is invalid: {reason} (move it away to start with a new key; relying parties then need the new JWKS)")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong (never key bytes).
        reason: String,
    },
    /// The key file could not be written.
    #[error("writing the JWT-SVID keys: {0}")]
    Write(#[from] meshca_certs::bundle::BundleError),
    /// The cluster Secret of the keys could not be read or written.
    #[error("{action} the Secret {namespace}/{name} of the JWT-SVID keys: {cause}")]
    Secret {
        /// What was being done.
        action: &'static str,
        /// meshca's namespace.
        namespace: String,
        /// The Secret.
        name: &'static str,
        /// The API's error.
        cause: String,
    },
    /// A key could not be generated.
    #[error("generating a JWT-SVID signing key ({0}) failed")]
    Generate(&'static str),
}

/// One key as the file keeps it.
#[derive(Clone, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct KeyRecord {
    /// The key ID (`kid`), random.
    pub(crate) kid: String,
    /// Its algorithm.
    pub(crate) alg: JwtAlgorithm,
    /// The private key, PKCS#8 DER, base64.
    pkcs8: String,
    /// When it starts signing (Unix seconds); it is published from when
    /// it is made.
    pub(crate) signs_from: i64,
}

impl std::fmt::Debug for KeyRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyRecord")
            .field("kid", &self.kid)
            .field("alg", &self.alg)
            .field("signs_from", &self.signs_from)
            .finish_non_exhaustive()
    }
}

#[derive(Serialize, Deserialize)]
struct KeyFile {
    keys: Vec<KeyRecord>,
}

impl KeyRecord {
    /// A new key of `alg` that signs from `signs_from`.
    pub(crate) fn generate(alg: JwtAlgorithm, signs_from: i64) -> Result<Self, JwtKeyError> {
        let rng = SystemRandom::new();
        let pkcs8 = match alg {
            JwtAlgorithm::Es256 => {
                EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng)
                    .map_err(|_| JwtKeyError::Generate("ES256"))?
                    .as_ref()
                    .to_vec()
            }
            JwtAlgorithm::Rs256 => {
                meshca_certs::PrivateKey::generate(meshca_certs::KeyAlgorithm::Rsa2048)
                    .map_err(|_| JwtKeyError::Generate("RS256"))?
                    .to_pkcs8_der()
            }
        };
        let mut kid = [0u8; 16];
        rng.fill(&mut kid)
            .map_err(|_| JwtKeyError::Generate("key ID"))?;
        Ok(Self {
            kid: URL_SAFE_NO_PAD.encode(kid),
            alg,
            pkcs8: STANDARD.encode(pkcs8),
            signs_from,
        })
    }

    /// The key, ready to sign.
    pub(crate) fn signer(&self) -> Result<Signer, String> {
        let der = STANDARD
            .decode(&self.pkcs8)
            .map_err(|_| format!("key {}: the private key is not base64", self.kid))?;
        let rng = SystemRandom::new();
        match self.alg {
            JwtAlgorithm::Es256 => {
                EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &der, &rng)
                    .map(Signer::Es256)
                    .map_err(|_| format!("key {}: not a PKCS#8 P-256 key", self.kid))
            }
            JwtAlgorithm::Rs256 => RsaKeyPair::from_pkcs8(&der)
                .map(Signer::Rs256)
                .map_err(|_| format!("key {}: not a PKCS#8 RSA key", self.kid)),
        }
    }
}

/// A key parsed once, to sign many tokens.
pub(crate) enum Signer {
    /// ECDSA P-256.
    Es256(EcdsaKeyPair),
    /// RSA PKCS#1 v1.5.
    Rs256(RsaKeyPair),
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Signer::Es256(_) => "Signer::Es256",
            Signer::Rs256(_) => "Signer::Rs256",
        })
    }
}

impl Signer {
    /// The JWS signature of `message` (ES256: r‖s, 64 bytes).
    pub(crate) fn sign(&self, message: &[u8]) -> Result<Vec<u8>, ring::error::Unspecified> {
        let rng = SystemRandom::new();
        match self {
            Signer::Es256(key) => Ok(key.sign(&rng, message)?.as_ref().to_vec()),
            Signer::Rs256(key) => {
                let mut signature = vec![0; key.public().modulus_len()];
                key.sign(
                    &ring::signature::RSA_PKCS1_SHA256,
                    &rng,
                    message,
                    &mut signature,
                )?;
                Ok(signature)
            }
        }
    }

    /// The public JWK members of the key (`kty` and its parameters).
    pub(crate) fn public_jwk(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut jwk = serde_json::Map::new();
        match self {
            Signer::Es256(key) => {
                // Uncompressed point: 0x04 ‖ x ‖ y.
                let point = key.public_key().as_ref();
                let (x, y) = point
                    .get(1..)
                    .unwrap_or_default()
                    .split_at(32.min(point.len().saturating_sub(1)));
                jwk.insert("kty".into(), "EC".into());
                jwk.insert("crv".into(), "P-256".into());
                jwk.insert("x".into(), URL_SAFE_NO_PAD.encode(x).into());
                jwk.insert("y".into(), URL_SAFE_NO_PAD.encode(y).into());
            }
            Signer::Rs256(key) => {
                let public = ring::rsa::PublicKeyComponents::<Vec<u8>>::from(key.public());
                let strip = |b: &[u8]| -> Vec<u8> {
                    b.iter().copied().skip_while(|&byte| byte == 0).collect()
                };
                let (n, e) = (strip(&public.n), strip(&public.e));
                jwk.insert("kty".into(), "RSA".into());
                jwk.insert("n".into(), URL_SAFE_NO_PAD.encode(n).into());
                jwk.insert("e".into(), URL_SAFE_NO_PAD.encode(e).into());
            }
        }
        jwk
    }
}

/// When keys are made, take over and leave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RotationPolicy {
    /// How long a key signs (`--jwt-key-rotation`).
    pub(crate) rotation: Duration,
    /// The longest lifetime of a token (`--max-jwt-svid-ttl`).
    pub(crate) max_ttl: Duration,
    /// The algorithm of new keys.
    pub(crate) alg: JwtAlgorithm,
}

impl RotationPolicy {
    /// How long a key is published before it signs: one maximum token
    /// lifetime.
    pub(crate) fn announce(&self) -> Duration {
        self.max_ttl
    }

    /// How long a retired key stays after its last token's expiry:
    /// [`CLOCK_SKEW`], at most one maximum lifetime.
    pub(crate) fn clock_skew(&self) -> Duration {
        CLOCK_SKEW.min(self.max_ttl)
    }

    /// How long a relying party may keep a bundle (the `Cache-Control`
    /// max-age of the JWKS, the agent's refresh): a quarter of the
    /// announcement, between 1 s and 5 min, so a key is fetched at least
    /// three times before it signs.
    pub(crate) fn bundle_max_age(&self) -> Duration {
        (self.announce() / 4).clamp(Duration::from_secs(1), Duration::from_secs(300))
    }
}

fn secs(d: Duration) -> i64 {
    i64::try_from(d.as_secs()).unwrap_or(i64::MAX)
}

/// What [`plan`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    /// The keys to keep and publish (oldest first).
    pub(crate) keys: Vec<KeyRecord>,
    /// Whether they differ from the keys given.
    pub(crate) changed: bool,
    /// When [`plan`] has something to do next (Unix seconds).
    pub(crate) next_event: i64,
}

/// The keys at `now`: a first key if there is none; retired keys whose
/// tokens have all expired dropped; the next key made once the current
/// one has signed `rotation − announce` (or at once, announced, when the
/// current key's algorithm is not the policy's).
pub(crate) fn plan(
    keys: &[KeyRecord],
    now: i64,
    policy: &RotationPolicy,
) -> Result<Plan, JwtKeyError> {
    let mut keys: Vec<KeyRecord> = keys.to_vec();
    keys.sort_by_key(|k| k.signs_from);
    let mut changed = false;
    if keys.iter().all(|k| k.signs_from > now) {
        // No key signs yet (first start, or a clock set back): one that
        // signs now. Nobody holds a token of ours, so nothing to announce.
        keys.push(KeyRecord::generate(policy.alg, now)?);
        keys.sort_by_key(|k| k.signs_from);
        changed = true;
    }
    let announce = secs(policy.announce());
    let keep_after_successor = secs(policy.max_ttl).saturating_add(secs(policy.clock_skew()));
    // Retire: a key whose successor has signed for longer than a token lives.
    let before = keys.len();
    let successors: Vec<i64> = keys.iter().skip(1).map(|k| k.signs_from).collect();
    let mut index = 0;
    keys.retain(|_| {
        let keep = successors
            .get(index)
            .is_none_or(|&from| now < from.saturating_add(keep_after_successor));
        index += 1;
        keep
    });
    changed |= keys.len() != before;

    let current = keys
        .iter()
        .rev()
        .find(|k| k.signs_from <= now)
        .cloned()
        .ok_or(JwtKeyError::Generate("no current key"))?;
    let pending = keys.iter().any(|k| k.signs_from > now);
    let prepare_at = current
        .signs_from
        .saturating_add(secs(policy.rotation))
        .saturating_sub(announce);
    if !pending && (now >= prepare_at || current.alg != policy.alg) {
        let signs_from = current
            .signs_from
            .saturating_add(secs(policy.rotation))
            .max(now.saturating_add(announce));
        let signs_from = if current.alg != policy.alg {
            now.saturating_add(announce)
        } else {
            signs_from
        };
        keys.push(KeyRecord::generate(policy.alg, signs_from)?);
        changed = true;
    }

    // The next thing to do: a key to prepare, one to start signing, one to retire.
    let mut next_event = i64::MAX;
    if !keys.iter().any(|k| k.signs_from > now) {
        next_event = next_event.min(prepare_at);
    }
    for k in keys.iter().filter(|k| k.signs_from > now) {
        next_event = next_event.min(k.signs_from);
    }
    for k in keys.iter().skip(1).filter(|k| k.signs_from <= now) {
        next_event = next_event.min(k.signs_from.saturating_add(keep_after_successor));
    }
    Ok(Plan {
        keys,
        changed,
        next_event: next_event.max(now.saturating_add(1)),
    })
}

/// The key that signs at `now`: the one that took over last.
#[cfg(test)]
pub(crate) fn current_index(keys: &[KeyRecord], now: i64) -> Option<usize> {
    keys.iter()
        .enumerate()
        .filter(|(_, k)| k.signs_from <= now)
        .max_by_key(|(_, k)| k.signs_from)
        .map(|(i, _)| i)
}

/// Reads the keys of `dir`, none if the file is absent.
pub(crate) fn load(dir: &Path) -> Result<Vec<KeyRecord>, JwtKeyError> {
    let path = dir.join(KEYS_FILE);
    let invalid = |reason: String| JwtKeyError::Invalid {
        path: path.clone(),
        reason,
    };
    let metadata = match std::fs::metadata(&path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(cause) => return Err(JwtKeyError::Read { path, cause }),
    };
    if metadata.len() > MAX_KEYS_FILE_BYTES {
        return Err(invalid(format!(
            "{} bytes, more than {MAX_KEYS_FILE_BYTES}",
            metadata.len()
        )));
    }
    let text = std::fs::read(&path).map_err(|cause| JwtKeyError::Read {
        path: path.clone(),
        cause,
    })?;
    parse(&text).map_err(invalid)
}

/// The keys of a key file's bytes (the file, or the cluster Secret's
/// value); the error says what is wrong, never with key bytes.
pub(crate) fn parse(text: &[u8]) -> Result<Vec<KeyRecord>, String> {
    if text.len() as u64 > MAX_KEYS_FILE_BYTES {
        return Err(format!(
            "{} bytes, more than {MAX_KEYS_FILE_BYTES}",
            text.len()
        ));
    }
    // serde's message names a line and column, never the value.
    let file: KeyFile = serde_json::from_slice(text).map_err(|e| {
        format!(
            "not the JSON meshca writes: line {}, column {}",
            e.line(),
            e.column()
        )
    })?;
    if file.keys.len() > MAX_KEYS {
        return Err(format!("{} keys, more than {MAX_KEYS}", file.keys.len()));
    }
    for key in &file.keys {
        key.signer()?;
    }
    Ok(file.keys)
}

/// A key file's bytes.
pub(crate) fn encode(keys: &[KeyRecord]) -> Result<Vec<u8>, JwtKeyError> {
    let file = KeyFile {
        keys: keys.to_vec(),
    };
    serde_json::to_vec_pretty(&file).map_err(|_| JwtKeyError::Generate("encoding"))
}

/// Writes `keys` to `dir` atomically, mode 0600.
pub(crate) fn save(dir: &Path, keys: &[KeyRecord]) -> Result<(), JwtKeyError> {
    let json = encode(keys)?;
    meshca_certs::bundle::write_file_atomic(&dir.join(KEYS_FILE), &json, 0o600)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: i64 = 3600;
    const DAY: i64 = 24 * HOUR;

    fn policy() -> RotationPolicy {
        RotationPolicy {
            rotation: Duration::from_secs(7 * DAY as u64),
            max_ttl: Duration::from_secs(HOUR as u64),
            alg: JwtAlgorithm::Es256,
        }
    }

    #[test]
    fn a_whole_rotation_publishes_the_next_key_a_max_ttl_ahead_and_keeps_the_old_one_until_its_tokens_expired(
    ) {
        let p = policy();
        let t0 = 1_000_000;
        let first = plan(&[], t0, &p).unwrap();
        assert!(first.changed);
        assert_eq!(first.keys.len(), 1);
        assert_eq!(first.keys[0].signs_from, t0);
        assert_eq!(
            first.next_event,
            t0 + 7 * DAY - HOUR,
            "the next key is prepared then"
        );

        // Nothing to do until then.
        let quiet = plan(&first.keys, t0 + 3 * DAY, &p).unwrap();
        assert!(!quiet.changed);
        assert_eq!(quiet.keys, first.keys);

        // One max TTL before the rotation, the next key is published.
        let prepared = plan(&first.keys, t0 + 7 * DAY - HOUR, &p).unwrap();
        assert!(prepared.changed);
        assert_eq!(prepared.keys.len(), 2);
        assert_eq!(prepared.keys[1].signs_from, t0 + 7 * DAY);
        assert!(prepared.keys[1].signs_from - (t0 + 7 * DAY - HOUR) >= HOUR);
        assert_eq!(
            current_index(&prepared.keys, t0 + 7 * DAY - 1),
            Some(0),
            "the old key still signs"
        );
        assert_eq!(current_index(&prepared.keys, t0 + 7 * DAY), Some(1));

        // After the switch both stay until the old key's tokens have expired.
        let switched = plan(&prepared.keys, t0 + 7 * DAY + HOUR, &p).unwrap();
        assert!(!switched.changed);
        assert_eq!(switched.keys.len(), 2);
        let retire_at = t0 + 7 * DAY + HOUR + CLOCK_SKEW.as_secs() as i64;
        assert_eq!(switched.next_event, retire_at);
        let retired = plan(&prepared.keys, retire_at, &p).unwrap();
        assert!(retired.changed);
        assert_eq!(retired.keys.len(), 1);
        assert_eq!(retired.keys[0].kid, prepared.keys[1].kid);
    }

    #[test]
    fn a_start_long_after_the_last_run_announces_before_switching() {
        let p = policy();
        let old = plan(&[], 0, &p).unwrap().keys;
        // Started 30 days later: the old key keeps signing one max TTL
        // while the new one is announced.
        let now = 30 * DAY;
        let late = plan(&old, now, &p).unwrap();
        assert_eq!(late.keys.len(), 2);
        assert_eq!(late.keys[1].signs_from, now + HOUR);
        assert_eq!(current_index(&late.keys, now), Some(0));
    }

    #[test]
    fn a_new_algorithm_is_announced_then_takes_over() {
        let p = policy();
        let es = plan(&[], 0, &p).unwrap().keys;
        let rs = RotationPolicy {
            alg: JwtAlgorithm::Rs256,
            ..p
        };
        let next = plan(&es, 10, &rs).unwrap();
        assert_eq!(next.keys.len(), 2);
        assert_eq!(next.keys[1].alg, JwtAlgorithm::Rs256);
        assert_eq!(next.keys[1].signs_from, 10 + HOUR);
        assert!(matches!(next.keys[1].signer().unwrap(), Signer::Rs256(_)));
    }

    #[test]
    fn keys_persist_with_mode_0600_and_a_bad_file_is_named_without_its_bytes() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        assert!(load(dir.path()).unwrap().is_empty());
        let keys = plan(&[], 5, &policy()).unwrap().keys;
        save(dir.path(), &keys).unwrap();
        assert_eq!(load(dir.path()).unwrap(), keys);
        let mode = std::fs::metadata(dir.path().join(KEYS_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        std::fs::write(
            dir.path().join(KEYS_FILE),
            b"{\"keys\": [{\"kid\": \"secret-stuff\"",
        )
        .unwrap();
        let error = load(dir.path()).unwrap_err().to_string();
        assert!(error.contains(KEYS_FILE), "{error}");
        assert!(!error.contains("secret-stuff"), "{error}");
        // A key record's Debug shows no key.
        assert!(!format!("{:?}", keys[0]).contains(&keys[0].pkcs8));
    }

    #[test]
    fn es256_signatures_verify_with_the_published_point() {
        let key = KeyRecord::generate(JwtAlgorithm::Es256, 0).unwrap();
        let signer = key.signer().unwrap();
        let signature = signer.sign(b"message").unwrap();
        assert_eq!(signature.len(), 64);
        let jwk = signer.public_jwk();
        let x = URL_SAFE_NO_PAD.decode(jwk["x"].as_str().unwrap()).unwrap();
        let y = URL_SAFE_NO_PAD.decode(jwk["y"].as_str().unwrap()).unwrap();
        let point = [&[4u8][..], &x, &y].concat();
        ring::signature::UnparsedPublicKey::new(&ring::signature::ECDSA_P256_SHA256_FIXED, point)
            .verify(b"message", &signature)
            .unwrap();
    }
}
