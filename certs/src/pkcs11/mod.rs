//! CA keys kept in a PKCS#11 token (an HSM, or SoftHSM2 for tests), used
//! through the `cryptoki` crate (feature `pkcs11`).
//!
//! [`HsmKey::open`] finds the private key a [`Pkcs11Uri`] names, reads its
//! public half from the token and signs with it: ECDSA P-256 (SHA-256),
//! P-384 (SHA-384) and RSA (PKCS#1 v1.5, SHA-256). The key never leaves
//! the token. [`HsmKey::generate`] makes a new key inside the token:
//! sensitive, not extractable, labelled by the URI's `object`.
//!
//! Sessions are kept and reused, as Vault and step-ca do: at most
//! [`SessionLimits::max_sessions`] at once, each logged in once when it is
//! opened; a caller finding all of them busy waits in a bounded queue
//! ([`SessionLimits::max_waiting`]) and beyond it is refused at once
//! ([`Pkcs11Error::Busy`]). A session whose call fails with an error of
//! the session, the token or the device is closed, not returned, and the
//! call is tried once more on a new session: a token that came back is
//! used again without a restart.
//!
//! The PIN is read from the file the URI's `pin-source` names and held
//! only as a `secrecy` string; it is in no message, log line or `Debug`.

mod uri;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant};

use cryptoki::context::{CInitializeArgs, CInitializeFlags, Pkcs11};
use cryptoki::error::{Error as CkError, RvError};
use cryptoki::mechanism::Mechanism;
use cryptoki::object::{Attribute, AttributeType, KeyType, ObjectClass, ObjectHandle};
use cryptoki::session::{Session, UserType};
use cryptoki::slot::Slot;
use cryptoki::types::AuthPin;

pub use uri::{Pkcs11Uri, UriError};

use crate::der::{self, tag};
use crate::keys::{KeyAlgorithm, KeyKind};
use crate::profile::{ExternalKey, ProfileError};

/// Why a key in a token could not be used. Every message names the URI,
/// never the PIN.
#[derive(Debug, thiserror::Error)]
pub enum Pkcs11Error {
    /// The URI is not usable.
    #[error(transparent)]
    Uri(#[from] UriError),
    /// The module could not be loaded or initialised.
    #[error("{uri}: the PKCS#11 module {} could not be loaded: {reason}", module.display())]
    Module {
        /// The key's URI.
        uri: String,
        /// The module file.
        module: PathBuf,
        /// What the loader or the module said.
        reason: String,
    },
    /// The PIN file could not be read.
    #[error("{uri}: reading the PIN from {}: {reason}", path.display())]
    PinFile {
        /// The key's URI.
        uri: String,
        /// The PIN file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// No token matches the URI.
    #[error("{uri}: no token matches (tokens present: {present})")]
    NoToken {
        /// The key's URI.
        uri: String,
        /// The labels of the tokens that are there.
        present: String,
    },
    /// The token refused the login.
    #[error("{uri}: the token refused the login: {reason}")]
    Login {
        /// The key's URI.
        uri: String,
        /// Why (e.g. the PIN is wrong, or the token is locked).
        reason: String,
    },
    /// The token holds no such private key.
    #[error("{uri}: the token holds no private key with {what}")]
    NoKey {
        /// The key's URI.
        uri: String,
        /// How the key was named.
        what: String,
    },
    /// Several private keys match: the URI must name one.
    #[error("{uri}: {count} private keys match {what}: add id=... to name one")]
    Ambiguous {
        /// The key's URI.
        uri: String,
        /// How many match.
        count: usize,
        /// How the key was named.
        what: String,
    },
    /// A key already has the label a new key was to get.
    #[error("{uri}: the token already holds a key with {what}; choose another object label")]
    Exists {
        /// The key's URI.
        uri: String,
        /// How the key was named.
        what: String,
    },
    /// The key is of a kind meshca does not sign with.
    #[error(
        "{uri}: the key is {kind}; meshca signs with ECDSA P-256, P-384 or RSA 2048-8192 keys"
    )]
    UnsupportedKey {
        /// The key's URI.
        uri: String,
        /// What it is.
        kind: String,
    },
    /// Every session is busy and the queue of waiting callers is full.
    #[error("{uri}: the HSM is busy: {sessions} sessions signing and {waiting} callers waiting")]
    Busy {
        /// The key's URI.
        uri: String,
        /// Sessions in use.
        sessions: usize,
        /// Callers waiting.
        waiting: usize,
    },
    /// A call to the token failed.
    #[error("{uri}: {operation} failed: {reason}")]
    Token {
        /// The key's URI.
        uri: String,
        /// What was being done.
        operation: &'static str,
        /// What the module answered (the PKCS#11 return value's name).
        reason: String,
    },
}

/// How many sessions a key keeps toward the token, and how many callers
/// may wait for one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionLimits {
    /// Sessions signing at once (default [`SessionLimits::DEFAULT_SESSIONS`]).
    pub max_sessions: usize,
    /// Callers waiting for a session before more are refused with
    /// [`Pkcs11Error::Busy`] (default [`SessionLimits::DEFAULT_WAITING`]).
    pub max_waiting: usize,
}

impl SessionLimits {
    /// Default sessions at once: what a small network HSM partition
    /// serves per client without queuing inside the HSM.
    pub const DEFAULT_SESSIONS: usize = 4;
    /// Default callers waiting for a session.
    pub const DEFAULT_WAITING: usize = 64;
}

impl Default for SessionLimits {
    fn default() -> Self {
        Self {
            max_sessions: Self::DEFAULT_SESSIONS,
            max_waiting: Self::DEFAULT_WAITING,
        }
    }
}

/// How the token protects a private key: what `CKA_SENSITIVE`,
/// `CKA_EXTRACTABLE` and their history attributes say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyProtection {
    /// `CKA_SENSITIVE`: the key's value cannot be read in the clear.
    pub sensitive: bool,
    /// `CKA_EXTRACTABLE`: the key can be wrapped out of the token.
    pub extractable: bool,
    /// `CKA_ALWAYS_SENSITIVE`: it was always sensitive.
    pub always_sensitive: bool,
    /// `CKA_NEVER_EXTRACTABLE`: it was never extractable.
    pub never_extractable: bool,
}

/// How often at most a key re-initialises its module when no session can
/// be opened (the token gone, or the module lost it).
pub const MODULE_REOPEN_INTERVAL: Duration = Duration::from_secs(5);

/// A loaded module: its context, and what re-initialising it needs.
#[derive(Clone)]
struct Module {
    ctx: Pkcs11,
    /// Bumped by every `C_Finalize` + `C_Initialize`: a session opened in an
    /// earlier generation is a stale handle (its number may now be
    /// another session's), never used or closed again.
    generation: Arc<AtomicU64>,
    /// Held (shared) by every call into the module, exclusively by a
    /// re-initialisation: PKCS#11 forbids `C_Finalize` during other calls.
    in_use: Arc<RwLock<()>>,
    /// When a key last re-initialised it (the bound is per module).
    last_reopen: Arc<Mutex<Option<Instant>>>,
}

/// The process's loaded modules, one context per module file: PKCS#11
/// allows one `C_Initialize` per process.
fn module(uri: &Pkcs11Uri) -> Result<Module, Pkcs11Error> {
    static MODULES: OnceLock<Mutex<HashMap<PathBuf, Module>>> = OnceLock::new();
    let mut modules = MODULES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(module) = modules.get(&uri.module_path) {
        return Ok(module.clone());
    }
    let fail = |reason: String| Pkcs11Error::Module {
        uri: uri.to_string(),
        module: uri.module_path.clone(),
        reason,
    };
    if !uri.module_path.exists() {
        return Err(fail("no such file".into()));
    }
    let ctx = Pkcs11::new(&uri.module_path).map_err(|e| fail(e.to_string()))?;
    match ctx.initialize(CInitializeArgs::new(CInitializeFlags::OS_LOCKING_OK)) {
        Ok(()) | Err(CkError::Pkcs11(RvError::CryptokiAlreadyInitialized, _)) => {}
        Err(e) => return Err(fail(rv(&e))),
    }
    let module = Module {
        ctx,
        generation: Arc::new(AtomicU64::new(0)),
        in_use: Arc::new(RwLock::new(())),
        last_reopen: Arc::default(),
    };
    modules.insert(uri.module_path.clone(), module.clone());
    Ok(module)
}

/// A PKCS#11 error as its function and return value's names (the crate's
/// own text is paragraphs long).
fn rv(e: &CkError) -> String {
    match e {
        CkError::Pkcs11(rv, function) => format!("{function} returned CKR_{rv:?}"),
        other => other.to_string(),
    }
}

/// Whether an error means the session (or the token under it) is gone,
/// so a new session may succeed where this one failed.
fn session_is_broken(e: &CkError) -> bool {
    matches!(
        e,
        CkError::Pkcs11(
            RvError::SessionHandleInvalid
                | RvError::SessionClosed
                | RvError::DeviceRemoved
                | RvError::DeviceError
                | RvError::DeviceMemory
                | RvError::TokenNotPresent
                | RvError::TokenNotRecognized
                | RvError::UserNotLoggedIn
                | RvError::GeneralError
                | RvError::FunctionFailed
                | RvError::KeyHandleInvalid
                | RvError::ObjectHandleInvalid,
            _
        )
    )
}

fn read_pin(uri: &Pkcs11Uri) -> Result<Option<AuthPin>, Pkcs11Error> {
    let Some(path) = &uri.pin_source else {
        return Ok(None);
    };
    let fail = |reason: String| Pkcs11Error::PinFile {
        uri: uri.to_string(),
        path: path.clone(),
        reason,
    };
    let meta = std::fs::metadata(path).map_err(|e| fail(e.to_string()))?;
    if meta.len() > 1024 {
        return Err(fail("longer than 1024 bytes: not a PIN file".into()));
    }
    let text = std::fs::read_to_string(path).map_err(|e| fail(e.to_string()))?;
    // One trailing newline (echo 1234 > pin) is not part of the PIN.
    let pin = text.strip_suffix('\n').unwrap_or(&text);
    let pin = pin.strip_suffix('\r').unwrap_or(pin);
    Ok(Some(AuthPin::new(pin.into())))
}

/// The slot holding the token the URI names.
fn find_slot(ctx: &Pkcs11, uri: &Pkcs11Uri) -> Result<Slot, Pkcs11Error> {
    let token_err = |operation, e: CkError| Pkcs11Error::Token {
        uri: uri.to_string(),
        operation,
        reason: rv(&e),
    };
    let slots = ctx
        .get_slots_with_initialized_token()
        .map_err(|e| token_err("listing the slots", e))?;
    let mut present = Vec::new();
    for slot in slots {
        let info = ctx
            .get_token_info(slot)
            .map_err(|e| token_err("reading a token's description", e))?;
        let matches = uri.slot_id.is_none_or(|id| id == slot.id())
            && uri
                .token
                .as_deref()
                .is_none_or(|t| t == info.label().trim_end())
            && uri
                .serial
                .as_deref()
                .is_none_or(|s| s == info.serial_number().trim_end())
            && uri
                .manufacturer
                .as_deref()
                .is_none_or(|m| m == info.manufacturer_id().trim_end())
            && uri
                .model
                .as_deref()
                .is_none_or(|m| m == info.model().trim_end());
        if matches {
            return Ok(slot);
        }
        present.push(format!("{:?}", info.label().trim_end()));
    }
    Err(Pkcs11Error::NoToken {
        uri: uri.to_string(),
        present: if present.is_empty() {
            "none".into()
        } else {
            present.join(", ")
        },
    })
}

/// A signing key inside a PKCS#11 token.
pub struct HsmKey {
    uri: Pkcs11Uri,
    ctx: Pkcs11,
    module: Module,
    /// The token's slot: found again when the module is re-initialised.
    slot: Mutex<Slot>,

    pin: Option<AuthPin>,
    spki: Vec<u8>,
    kind: KeyKind,
    limits: SessionLimits,
    pool: Mutex<Pool>,
    freed: Condvar,
}

/// The sessions: idle ones ready to sign, and counts.
struct Pool {
    /// With the module generation each was opened in.
    idle: Vec<(Session, ObjectHandle, u64)>,
    /// Sessions open (idle or signing).
    open: usize,
    /// Callers waiting for one.
    waiting: usize,
}

impl Drop for HsmKey {
    /// Closes the idle sessions with no re-initialisation in flight;
    /// sessions of an earlier module generation are stale handles, never
    /// closed (their number may now be another key's session).
    fn drop(&mut self) {
        // Never blocks: a key may be dropped by a thread that holds the
        // shared lock already (a failed open); if a re-initialisation is
        // waiting or running, the sessions are left to it (forgotten here).
        let using = match self.module.in_use.try_read() {
            Ok(guard) => Some(guard),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        };
        let current = self.module.generation.load(Ordering::SeqCst);
        let pool = self.pool.get_mut().unwrap_or_else(|p| p.into_inner());
        for (session, _, generation) in pool.idle.drain(..) {
            if using.is_some() && generation == current {
                drop(session);
            } else {
                std::mem::forget(session);
            }
        }
    }
}

/// How one call on a pooled session went wrong.
enum Attempt {
    /// No session: the pool is full, or a new one could not be opened.
    NoSession(Pkcs11Error),
    /// The call broke its session (closed): a new one may succeed.
    Broke(CkError),
    /// The call failed, the session is fine.
    Failed(CkError),
}

impl std::fmt::Debug for HsmKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HsmKey")
            .field("uri", &self.uri.as_str())
            .field("kind", &self.kind)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl HsmKey {
    /// Opens the key `uri` names: loads the module, finds the token, logs
    /// in with the PIN from `pin-source`, finds the private key and reads
    /// its public half. A wrong PIN, a missing token or key is an error
    /// naming the URI.
    pub fn open(uri: &Pkcs11Uri, limits: SessionLimits) -> Result<Self, Pkcs11Error> {
        let module = module(uri)?;
        let ctx = module.ctx.clone();
        let _using = module.in_use.read().unwrap_or_else(|p| p.into_inner());
        let generation = module.generation.load(Ordering::SeqCst);
        let slot = find_slot(&ctx, uri)?;
        let pin = read_pin(uri)?;
        let limits = SessionLimits {
            max_sessions: limits.max_sessions.max(1),
            max_waiting: limits.max_waiting,
        };
        let mut key = Self {
            uri: uri.clone(),
            ctx,
            module: module.clone(),
            slot: Mutex::new(slot),
            pin,
            spki: Vec::new(),
            kind: KeyKind::Other,
            limits,
            pool: Mutex::new(Pool {
                idle: Vec::new(),
                open: 0,
                waiting: 0,
            }),
            freed: Condvar::new(),
        };
        let (session, private) = key.new_session()?;
        let (spki, kind) = key.read_public_key(&session, private)?;
        if !matches!(kind, KeyKind::EcdsaP256 | KeyKind::EcdsaP384)
            && !matches!(kind, KeyKind::Rsa(bits) if (2048..=8192).contains(&bits))
        {
            return Err(Pkcs11Error::UnsupportedKey {
                uri: uri.to_string(),
                kind: kind.to_string(),
            });
        }
        key.spki = spki;
        key.kind = kind;
        let pool = key.pool.get_mut().unwrap_or_else(|p| p.into_inner());
        pool.idle.push((session, private, generation));
        pool.open = 1;
        drop(_using);
        Ok(key)
    }

    /// Makes a new key pair inside the token, labelled by the URI's
    /// `object` (and `id` if given, else a random one): the private key
    /// sensitive and not extractable, both kept on the token. Refused if
    /// a key with that label or id exists. Returns the key, opened.
    pub fn generate(
        uri: &Pkcs11Uri,
        algorithm: KeyAlgorithm,
        limits: SessionLimits,
    ) -> Result<Self, Pkcs11Error> {
        let label = uri.object.clone().ok_or_else(|| UriError {
            uri: uri.to_string(),
            reason: "a new key needs a label: give object=LABEL".into(),
        })?;
        let module = module(uri)?;
        let ctx = module.ctx.clone();
        let using = module.in_use.read().unwrap_or_else(|p| p.into_inner());
        let slot = find_slot(&ctx, uri)?;
        let pin = read_pin(uri)?;
        let token_err = |operation, e: CkError| Pkcs11Error::Token {
            uri: uri.to_string(),
            operation,
            reason: rv(&e),
        };
        let session = ctx
            .open_rw_session(slot)
            .map_err(|e| token_err("opening a session", e))?;
        login(&session, uri, pin.as_ref())?;
        let mut taken = vec![Attribute::Label(label.as_bytes().to_vec())];
        if let Some(id) = &uri.id {
            taken = vec![Attribute::Id(id.clone())];
        }
        let existing = session
            .find_objects(&taken)
            .map_err(|e| token_err("looking for existing keys", e))?;
        if !existing.is_empty() {
            return Err(Pkcs11Error::Exists {
                uri: uri.to_string(),
                what: uri.describe_object(),
            });
        }
        let id = match &uri.id {
            Some(id) => id.clone(),
            None => {
                let mut id = vec![0u8; 16];
                session
                    .generate_random_slice(&mut id)
                    .map_err(|e| token_err("drawing a key id", e))?;
                id
            }
        };
        let (mechanism, mut public) = match algorithm {
            KeyAlgorithm::EcdsaP256 => (
                Mechanism::EccKeyPairGen,
                vec![Attribute::EcParams(OID_P256_DER.to_vec())],
            ),
            KeyAlgorithm::EcdsaP384 => (
                Mechanism::EccKeyPairGen,
                vec![Attribute::EcParams(OID_P384_DER.to_vec())],
            ),
            rsa => {
                let bits: u64 = match rsa {
                    KeyAlgorithm::Rsa3072 => 3072,
                    KeyAlgorithm::Rsa4096 => 4096,
                    _ => 2048,
                };
                (
                    Mechanism::RsaPkcsKeyPairGen,
                    vec![
                        Attribute::ModulusBits(bits.into()),
                        Attribute::PublicExponent(vec![0x01, 0x00, 0x01]),
                    ],
                )
            }
        };
        public.extend([
            Attribute::Token(true),
            Attribute::Private(false),
            Attribute::Verify(true),
            Attribute::Label(label.as_bytes().to_vec()),
            Attribute::Id(id.clone()),
        ]);
        let private = [
            Attribute::Token(true),
            Attribute::Private(true),
            Attribute::Sensitive(true),
            Attribute::Extractable(false),
            Attribute::Sign(true),
            // A CA key signs and does nothing else.
            Attribute::Decrypt(false),
            Attribute::Unwrap(false),
            Attribute::Derive(false),
            Attribute::Label(label.as_bytes().to_vec()),
            Attribute::Id(id.clone()),
        ];
        session
            .generate_key_pair(&mechanism, &public, &private)
            .map_err(|e| token_err("generating the key pair", e))?;
        drop(session);
        drop(using);
        let mut named = uri.clone();
        named.id = Some(id);
        let mut key = Self::open(&named, limits)?;
        // Messages keep naming the key as the operator wrote it.
        key.uri = uri.clone();
        Ok(key)
    }

    /// The key's URI.
    pub fn uri(&self) -> &Pkcs11Uri {
        &self.uri
    }

    /// The public key, DER SubjectPublicKeyInfo.
    pub fn public_key_spki_der(&self) -> &[u8] {
        &self.spki
    }

    /// What kind of key it is.
    pub fn kind(&self) -> KeyKind {
        self.kind
    }

    /// How the token protects the private key.
    pub fn protection(&self) -> Result<KeyProtection, Pkcs11Error> {
        self.with_session(|session, private| {
            let attrs = session.get_attributes(
                private,
                &[
                    AttributeType::Sensitive,
                    AttributeType::Extractable,
                    AttributeType::AlwaysSensitive,
                    AttributeType::NeverExtractable,
                ],
            )?;
            let mut p = KeyProtection {
                sensitive: false,
                extractable: true,
                always_sensitive: false,
                never_extractable: false,
            };
            for a in attrs {
                match a {
                    Attribute::Sensitive(v) => p.sensitive = v,
                    Attribute::Extractable(v) => p.extractable = v,
                    Attribute::AlwaysSensitive(v) => p.always_sensitive = v,
                    Attribute::NeverExtractable(v) => p.never_extractable = v,
                    _ => {}
                }
            }
            Ok(p)
        })
    }

    /// Signs `message` as X.509 wants it for this key: ECDSA over SHA-256
    /// (P-256) or SHA-384 (P-384), DER `ECDSA-Sig-Value`; RSA PKCS#1 v1.5
    /// over SHA-256.
    pub fn sign_message(&self, message: &[u8]) -> Result<Vec<u8>, Pkcs11Error> {
        match self.kind {
            KeyKind::EcdsaP256 | KeyKind::EcdsaP384 => {
                let (alg, half) = if self.kind == KeyKind::EcdsaP256 {
                    (&ring::digest::SHA256, 32)
                } else {
                    (&ring::digest::SHA384, 48)
                };
                let digest = ring::digest::digest(alg, message);
                let raw = self.with_session(|session, private| {
                    session.sign(&Mechanism::Ecdsa, private, digest.as_ref())
                })?;
                if raw.len() != 2 * half {
                    return Err(Pkcs11Error::Token {
                        uri: self.uri.to_string(),
                        operation: "signing",
                        reason: format!(
                            "the module returned a {}-byte ECDSA signature, expected {}",
                            raw.len(),
                            2 * half
                        ),
                    });
                }
                let mut sig = Vec::with_capacity(2 * half + 8);
                der::write_nested(&mut sig, tag::SEQUENCE, |seq| {
                    der::write_unsigned_integer(seq, &raw[..half]);
                    der::write_unsigned_integer(seq, &raw[half..]);
                });
                Ok(sig)
            }
            _ => self.with_session(|session, private| {
                session.sign(&Mechanism::Sha256RsaPkcs, private, message)
            }),
        }
    }

    /// Opens and logs in a new session and finds the private key in it.
    fn new_session(&self) -> Result<(Session, ObjectHandle), Pkcs11Error> {
        let token_err = |operation, e: CkError| Pkcs11Error::Token {
            uri: self.uri.to_string(),
            operation,
            reason: rv(&e),
        };
        let slot = *self.slot.lock().unwrap_or_else(|p| p.into_inner());
        let session = self
            .ctx
            .open_ro_session(slot)
            .map_err(|e| token_err("opening a session", e))?;
        login(&session, &self.uri, self.pin.as_ref())?;
        let mut template = vec![Attribute::Class(ObjectClass::PRIVATE_KEY)];
        if let Some(label) = &self.uri.object {
            template.push(Attribute::Label(label.as_bytes().to_vec()));
        }
        if let Some(id) = &self.uri.id {
            template.push(Attribute::Id(id.clone()));
        }
        let found = session
            .find_objects(&template)
            .map_err(|e| token_err("looking for the key", e))?;
        match found.as_slice() {
            [one] => Ok((session, *one)),
            [] => Err(Pkcs11Error::NoKey {
                uri: self.uri.to_string(),
                what: self.uri.describe_object(),
            }),
            many => Err(Pkcs11Error::Ambiguous {
                uri: self.uri.to_string(),
                count: many.len(),
                what: self.uri.describe_object(),
            }),
        }
    }

    /// The public key of `private`: from the public key object with the
    /// same id (or label), else (RSA) from the private key's own modulus.
    fn read_public_key(
        &self,
        session: &Session,
        private: ObjectHandle,
    ) -> Result<(Vec<u8>, KeyKind), Pkcs11Error> {
        let token_err = |operation, e: CkError| Pkcs11Error::Token {
            uri: self.uri.to_string(),
            operation,
            reason: rv(&e),
        };
        let attrs = session
            .get_attributes(private, &[AttributeType::KeyType, AttributeType::Id])
            .map_err(|e| token_err("reading the key's type", e))?;
        let mut key_type = None;
        let mut id = None;
        for a in attrs {
            match a {
                Attribute::KeyType(t) => key_type = Some(t),
                Attribute::Id(i) => id = Some(i),
                _ => {}
            }
        }
        let mut template = vec![Attribute::Class(ObjectClass::PUBLIC_KEY)];
        match (&id, &self.uri.object) {
            (Some(id), _) if !id.is_empty() => template.push(Attribute::Id(id.clone())),
            (_, Some(label)) => template.push(Attribute::Label(label.as_bytes().to_vec())),
            _ => {}
        }
        let public = session
            .find_objects(&template)
            .map_err(|e| token_err("looking for the public key", e))?
            .first()
            .copied();
        let unsupported = |kind: String| Pkcs11Error::UnsupportedKey {
            uri: self.uri.to_string(),
            kind,
        };
        match key_type {
            Some(KeyType::EC) => {
                let Some(public) = public else {
                    return Err(Pkcs11Error::NoKey {
                        uri: self.uri.to_string(),
                        what: format!("{} (its public key object)", self.uri.describe_object()),
                    });
                };
                let mut params = None;
                let mut point = None;
                for a in session
                    .get_attributes(public, &[AttributeType::EcParams, AttributeType::EcPoint])
                    .map_err(|e| token_err("reading the public key", e))?
                {
                    match a {
                        Attribute::EcParams(p) => params = Some(p),
                        Attribute::EcPoint(p) => point = Some(p),
                        _ => {}
                    }
                }
                let (Some(params), Some(point)) = (params, point) else {
                    return Err(unsupported("an EC key without its curve or point".into()));
                };
                let point = unwrap_ec_point(&point);
                let mut spki = Vec::with_capacity(point.len() + 32);
                der::write_nested(&mut spki, tag::SEQUENCE, |s| {
                    der::write_nested(s, tag::SEQUENCE, |alg| {
                        der::write_tlv(alg, tag::OID, OID_EC_PUBLIC_KEY);
                        alg.extend_from_slice(&params);
                    });
                    der::write_nested(s, tag::BIT_STRING, |bits| {
                        bits.push(0);
                        bits.extend_from_slice(point);
                    });
                });
                let kind = KeyKind::from_spki_der(&spki).map_err(|e| {
                    unsupported(format!("an EC key the module describes badly ({e})"))
                })?;
                Ok((spki, kind))
            }
            Some(KeyType::RSA) => {
                let from = public.unwrap_or(private);
                let mut modulus = None;
                let mut exponent = None;
                for a in session
                    .get_attributes(
                        from,
                        &[AttributeType::Modulus, AttributeType::PublicExponent],
                    )
                    .map_err(|e| token_err("reading the public key", e))?
                {
                    match a {
                        Attribute::Modulus(m) => modulus = Some(m),
                        Attribute::PublicExponent(e) => exponent = Some(e),
                        _ => {}
                    }
                }
                let (Some(n), Some(e)) = (modulus, exponent) else {
                    return Err(unsupported("an RSA key without its modulus".into()));
                };
                let mut spki = Vec::with_capacity(n.len() + 48);
                der::write_nested(&mut spki, tag::SEQUENCE, |s| {
                    der::write_nested(s, tag::SEQUENCE, |alg| {
                        der::write_tlv(alg, tag::OID, OID_RSA_ENCRYPTION);
                        der::write_tlv(alg, 0x05, &[]);
                    });
                    der::write_nested(s, tag::BIT_STRING, |bits| {
                        bits.push(0);
                        der::write_nested(bits, tag::SEQUENCE, |k| {
                            der::write_unsigned_integer(k, strip_zeros(&n));
                            der::write_unsigned_integer(k, strip_zeros(&e));
                        });
                    });
                });
                let kind = KeyKind::from_spki_der(&spki).map_err(|e| {
                    unsupported(format!("an RSA key the module describes badly ({e})"))
                })?;
                Ok((spki, kind))
            }
            Some(other) => Err(unsupported(format!("a {other} key"))),
            None => Err(unsupported("a key of unknown type".into())),
        }
    }

    /// Runs `f` on a logged-in session holding the key: an idle one, a new
    /// one while fewer than `max_sessions` are open, else after waiting in
    /// the queue. A session whose call broke is closed and the call tried
    /// once more on a new session.
    fn with_session<T>(
        &self,
        f: impl Fn(&Session, ObjectHandle) -> Result<T, CkError>,
    ) -> Result<T, Pkcs11Error> {
        let mut retried = false;
        let mut reopened = false;
        loop {
            let attempt = {
                let _using = self.module.in_use.read().unwrap_or_else(|p| p.into_inner());
                self.attempt(&f)
            };
            match attempt {
                Ok(value) => return Ok(value),
                Err(Attempt::Broke(e)) if !retried => {
                    retried = true;
                    tracing::warn!(uri = %self.uri, error = %rv(&e), "a PKCS#11 session broke: trying once more on a new session");
                }
                Err(Attempt::Broke(e)) | Err(Attempt::Failed(e)) => {
                    return Err(Pkcs11Error::Token {
                        uri: self.uri.to_string(),
                        operation: "signing",
                        reason: rv(&e),
                    })
                }
                Err(Attempt::NoSession(e)) if !reopened && self.may_reopen(&e) => {
                    reopened = true;
                    self.reopen_module().map_err(|_| e)?;
                }
                Err(Attempt::NoSession(e)) => return Err(e),
            }
        }
    }

    /// One call on a session of the pool (the caller holds the module's
    /// shared lock). A session whose call broke is closed, never returned.
    fn attempt<T>(
        &self,
        f: &impl Fn(&Session, ObjectHandle) -> Result<T, CkError>,
    ) -> Result<T, Attempt> {
        let (session, private) = self.take().map_err(Attempt::NoSession)?;
        match f(&session, private) {
            Ok(value) => {
                self.put_back(Some((session, private)));
                Ok(value)
            }
            Err(e) if session_is_broken(&e) => {
                // The next caller opens a new session (and logs in again).
                drop(session);
                self.put_back(None);
                Err(Attempt::Broke(e))
            }
            Err(e) => {
                self.put_back(Some((session, private)));
                Err(Attempt::Failed(e))
            }
        }
    }

    /// Whether a failure to get a session may be the module having lost
    /// the token (re-initialising it may help), and the last attempt is
    /// at least [`MODULE_REOPEN_INTERVAL`] ago.
    fn may_reopen(&self, e: &Pkcs11Error) -> bool {
        let lost = match e {
            // Too many sessions is the token's bound, not a lost token.
            Pkcs11Error::Token { reason, .. } => !reason.contains("CKR_SessionCount"),
            Pkcs11Error::NoToken { .. } | Pkcs11Error::NoKey { .. } => true,
            // A module that lost its token may fail the login (SoftHSM2:
            // CKR_GENERAL_ERROR); a wrong or locked PIN is not that.
            Pkcs11Error::Login { reason, .. } => !reason.contains("CKR_PIN_"),
            _ => false,
        };
        if !lost {
            return false;
        }
        let mut last = self
            .module
            .last_reopen
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if last.is_some_and(|at| at.elapsed() < MODULE_REOPEN_INTERVAL) {
            return false;
        }
        *last = Some(Instant::now());
        true
    }

    /// Re-initialises the module (`C_Finalize`, `C_Initialize`) with no
    /// other call in flight, and finds the token's slot again: a module
    /// such as SoftHSM2 reads its tokens at `C_Initialize` only, so a token
    /// that went away and came back is seen again only after this. Every
    /// session of the module (this key's and any other's) is then stale.
    fn reopen_module(&self) -> Result<(), Pkcs11Error> {
        let _exclusive = self
            .module
            .in_use
            .write()
            .unwrap_or_else(|p| p.into_inner());
        let stale = {
            let mut pool = self.lock();
            let stale = std::mem::take(&mut pool.idle);
            pool.open = pool.open.saturating_sub(stale.len());
            stale
        };
        // Closed while the module still knows them.
        drop(stale);
        let _ = self.ctx.clone().finalize();
        self.module.generation.fetch_add(1, Ordering::SeqCst);
        let module_err = |e: CkError| Pkcs11Error::Module {
            uri: self.uri.to_string(),
            module: self.uri.module_path.clone(),
            reason: rv(&e),
        };
        match self
            .ctx
            .initialize(CInitializeArgs::new(CInitializeFlags::OS_LOCKING_OK))
        {
            Ok(()) | Err(CkError::Pkcs11(RvError::CryptokiAlreadyInitialized, _)) => {}
            Err(e) => return Err(module_err(e)),
        }
        let slot = find_slot(&self.ctx, &self.uri)?;
        *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = slot;
        tracing::warn!(uri = %self.uri, "the PKCS#11 module was re-initialised and the token found again");
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn take(&self) -> Result<(Session, ObjectHandle), Pkcs11Error> {
        let mut pool = self.lock();
        let mut queued = false;
        let result = loop {
            if let Some((session, private, generation)) = pool.idle.pop() {
                if generation == self.module.generation.load(Ordering::SeqCst) {
                    break Ok(Some((session, private)));
                }
                // Opened before the module was re-initialised: its handle
                // may now name another session, so it is never closed.
                std::mem::forget(session);
                pool.open = pool.open.saturating_sub(1);
                continue;
            }
            if pool.open < self.limits.max_sessions {
                pool.open += 1;
                break Ok(None);
            }
            if !queued {
                if pool.waiting >= self.limits.max_waiting {
                    break Err(Pkcs11Error::Busy {
                        uri: self.uri.to_string(),
                        sessions: pool.open,
                        waiting: pool.waiting,
                    });
                }
                pool.waiting += 1;
                queued = true;
            }
            pool = self.freed.wait(pool).unwrap_or_else(|p| p.into_inner());
        };
        if queued {
            pool.waiting -= 1;
        }
        drop(pool);
        match result? {
            Some(idle) => Ok(idle),
            None => self.new_session().inspect_err(|_| self.put_back(None)),
        }
    }

    /// Returns a session to the pool, or (None) counts one closed.
    fn put_back(&self, session: Option<(Session, ObjectHandle)>) {
        let mut pool = self.lock();
        match session {
            Some((session, private)) => {
                let generation = self.module.generation.load(Ordering::SeqCst);
                pool.idle.push((session, private, generation))
            }
            None => pool.open = pool.open.saturating_sub(1),
        }
        drop(pool);
        self.freed.notify_one();
    }
}

impl ExternalKey for HsmKey {
    fn public_key_spki_der(&self) -> &[u8] {
        &self.spki
    }

    fn kind(&self) -> KeyKind {
        self.kind
    }

    fn sign(&self, message: &[u8]) -> Result<Vec<u8>, ProfileError> {
        self.sign_message(message).map_err(|e| match e {
            Pkcs11Error::Busy { .. } => ProfileError::KeyBusy(e.to_string()),
            other => ProfileError::KeyUnavailable(other.to_string()),
        })
    }

    fn name(&self) -> &str {
        self.uri.as_str()
    }
}

/// Logs `session` in as the user; already logged in (another session of
/// this process did) is fine.
fn login(session: &Session, uri: &Pkcs11Uri, pin: Option<&AuthPin>) -> Result<(), Pkcs11Error> {
    match session.login(UserType::User, pin) {
        Ok(()) | Err(CkError::Pkcs11(RvError::UserAlreadyLoggedIn, _)) => Ok(()),
        Err(e) => Err(Pkcs11Error::Login {
            uri: uri.to_string(),
            reason: match &e {
                CkError::Pkcs11(RvError::PinIncorrect, _) => {
                    "the PIN is wrong (CKR_PIN_INCORRECT)".into()
                }
                CkError::Pkcs11(RvError::PinLocked, _) => {
                    "the PIN is locked (CKR_PIN_LOCKED)".into()
                }
                _ if pin.is_none() => format!("{} (the URI names no pin-source)", rv(&e)),
                _ => rv(&e),
            },
        }),
    }
}

/// `CKA_EC_POINT` is a DER OCTET STRING holding the point; some modules
/// return the bare point. Either way, the point.
fn unwrap_ec_point(value: &[u8]) -> &[u8] {
    match value {
        [tag::OCTET_STRING, len, rest @ ..] if usize::from(*len) == rest.len() && *len < 0x80 => {
            rest
        }
        [tag::OCTET_STRING, 0x81, len, rest @ ..] if usize::from(*len) == rest.len() => rest,
        bare => bare,
    }
}

fn strip_zeros(bytes: &[u8]) -> &[u8] {
    let first = bytes.iter().position(|b| *b != 0).unwrap_or(bytes.len());
    &bytes[first..]
}

/// id-ecPublicKey, the OID's content.
const OID_EC_PUBLIC_KEY: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01];
/// rsaEncryption, the OID's content.
const OID_RSA_ENCRYPTION: &[u8] = &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x01];
/// prime256v1 as a DER OID (what `CKA_EC_PARAMS` holds).
const OID_P256_DER: &[u8] = &[0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07];
/// secp384r1 as a DER OID.
const OID_P384_DER: &[u8] = &[0x06, 0x05, 0x2b, 0x81, 0x04, 0x00, 0x22];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ec_points_are_found_wrapped_or_bare() {
        let bare = [0x04u8; 65];
        let mut wrapped = vec![tag::OCTET_STRING, 65];
        wrapped.extend_from_slice(&bare);
        assert_eq!(unwrap_ec_point(&wrapped), &bare[..]);
        assert_eq!(unwrap_ec_point(&bare), &bare[..]);
    }

    #[test]
    fn a_missing_module_is_named_with_the_uri() {
        let uri: Pkcs11Uri = "pkcs11:token=t;object=k?module-path=/nonexistent/libnone.so"
            .parse()
            .unwrap();
        let e = HsmKey::open(&uri, SessionLimits::default()).unwrap_err();
        let message = e.to_string();
        assert!(message.contains("pkcs11:token=t;object=k"), "{message}");
        assert!(message.contains("/nonexistent/libnone.so"), "{message}");
    }
}
