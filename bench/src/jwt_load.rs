//! `meshca-bench --jwt-svid`: the load run with `MintJwtSvid`
//! (`meshca.v1.JwtSvidService`, one JWT-SVID per request) instead of
//! `CreateCertificate`. The identities, tokens, connections, CPU
//! accounting and report are the X.509 run's; the crypto limit is one
//! JWT-SVID's: one ES256 signature plus the request's token check (an
//! ES256 verification), measured like the X.509 limit (one thread, ring
//! directly, 2 s before the load and 2 s after it).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use meshca_certs::token::{TokenIssuer, TokenRequest};
use meshca_certs::SpiffeId;
use meshca_proto::meshca::v1::jwt_svid_service_client::JwtSvidServiceClient;
use meshca_proto::meshca::v1::MintJwtSvidRequest;
use ring::signature::{self, EcdsaKeyPair, KeyPair as _};
use serde_json::json;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

use crate::baseline::{per_second, Baseline};
use crate::report::{new_histogram, RunReport, WindowEdge};
use crate::RunArgs;

type Authorization = tonic::metadata::MetadataValue<tonic::metadata::Ascii>;

/// `meshca-bench jwt-svid`: the flags of the load run.
#[derive(Debug, clap::Args)]
pub(crate) struct JwtSvidArgs {
    #[command(flatten)]
    pub(crate) run: RunArgs,
}

/// The audience of every token asked for.
const AUDIENCE: &str = "meshca-bench";

/// Each identity's `authorization` header, made before the clock starts.
fn prepare(args: &RunArgs) -> anyhow::Result<Vec<Authorization>> {
    let bearer = |token: &str| -> anyhow::Result<Authorization> {
        format!("Bearer {token}")
            .parse()
            .context("a token is not a valid header value")
    };
    if let Some(path) = &args.tokens {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("--tokens {}", path.display()))?;
        return text
            .lines()
            .filter_map(|l| l.split_whitespace().nth(2))
            .map(bearer)
            .collect();
    }
    let dir = args
        .data_dir
        .as_ref()
        .context("--jwt-svid needs --data-dir (its local token issuer) or --tokens")?;
    let issuer = TokenIssuer::load(dir)
        .with_context(|| format!("--data-dir {}: local token issuer", dir.display()))?;
    (0..args.identities.max(1))
        .map(|i| {
            let token = issuer.mint(
                &TokenRequest {
                    namespace: "bench".into(),
                    service_account: format!("sa-{i}"),
                    audiences: vec!["istio-ca".into()],
                    ttl: Duration::from_secs(3600),
                    pod: None,
                },
                std::time::SystemTime::now(),
            )?;
            bearer(&token)
        })
        .collect()
}

async fn connect(args: &RunArgs) -> anyhow::Result<Vec<JwtSvidServiceClient<Channel>>> {
    let root_path = args
        .root_cert
        .clone()
        .or_else(|| args.data_dir.as_ref().map(|d| d.join("root-cert.pem")))
        .context("--root-cert (or --data-dir) is needed to trust the CA's TLS certificate")?;
    let root_pem = std::fs::read_to_string(&root_path)
        .with_context(|| format!("--root-cert {}", root_path.display()))?;
    let mut clients = Vec::new();
    for _ in 0..args.connections.max(1) {
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&root_pem))
            .domain_name("istiod.istio-system.svc");
        let channel = Endpoint::from_shared(args.addr.clone())
            .context("--addr")?
            .tls_config(tls)
            .context("TLS configuration")?
            .connect_timeout(Duration::from_secs(5))
            .connect()
            .await
            .with_context(|| format!("connecting to {}", args.addr))?;
        clients.push(JwtSvidServiceClient::new(channel));
    }
    Ok(clients)
}

/// Drives `concurrency` callers over `clients` for `duration` (or
/// `count` requests).
async fn drive(
    clients: &[JwtSvidServiceClient<Channel>],
    prepared: &Arc<Vec<Authorization>>,
    concurrency: usize,
    duration: Option<Duration>,
    count: Option<u64>,
) -> crate::load::Driven {
    let next = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let mut workers = Vec::new();
    for w in 0..concurrency.max(1) {
        let mut client = clients[w % clients.len()].clone();
        let (next, stop, prepared) = (next.clone(), stop.clone(), prepared.clone());
        workers.push(tokio::spawn(async move {
            let mut latency = new_histogram();
            let mut errors: BTreeMap<String, u64> = BTreeMap::new();
            let mut ok = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if count.is_some_and(|c| i >= c) || duration.is_some_and(|d| start.elapsed() >= d) {
                    break;
                }
                let mut request = tonic::Request::new(MintJwtSvidRequest {
                    audiences: vec![AUDIENCE.to_string()],
                    lifetime_seconds: 0,
                    impersonated_identity: String::new(),
                });
                request.metadata_mut().insert(
                    "authorization",
                    prepared[(i as usize) % prepared.len()].clone(),
                );
                let t = Instant::now();
                match client.mint_jwt_svid(request).await {
                    Ok(r) if r.get_ref().token.split('.').count() == 3 => {
                        ok += 1;
                        let _ = latency.record(t.elapsed().as_micros().max(1) as u64);
                    }
                    Ok(_) => *errors.entry("NOT_A_JWT".into()).or_default() += 1,
                    Err(s) => *errors.entry(format!("{:?}", s.code())).or_default() += 1,
                }
            }
            (ok, errors, latency)
        }));
    }
    let mut driven = crate::load::Driven {
        ok: 0,
        errors: BTreeMap::new(),
        latency: new_histogram(),
        elapsed: Duration::ZERO,
    };
    for w in workers {
        if let Ok((ok, errors, latency)) = w.await {
            driven.ok += ok;
            for (k, v) in errors {
                *driven.errors.entry(k).or_default() += v;
            }
            let _ = driven.latency.add(&latency);
        }
    }
    stop.store(true, Ordering::Relaxed);
    driven.elapsed = start.elapsed();
    driven
}

/// The crypto of one JWT-SVID, ready to time.
struct JwtYardstick {
    rng: ring::rand::SystemRandom,
    key: EcdsaKeyPair,
    /// A JWT-SVID's signing input (header.claims, base64url): ~250 bytes.
    signing_input: Vec<u8>,
    /// The caller's token: its signing input (as long as the run's
    /// tokens'), signature and key.
    token_input: Vec<u8>,
    token_sig: Vec<u8>,
    token_public: Vec<u8>,
}

/// One measurement: JWT-SVIDs per second with the token check, and without.
#[derive(Clone, Copy)]
struct JwtLimits {
    full: f64,
    sign_only: f64,
}

impl JwtYardstick {
    /// The yardstick for tokens whose signing input is `token_len` bytes.
    fn new(token_len: usize) -> anyhow::Result<Self> {
        let rng = ring::rand::SystemRandom::new();
        let alg = &signature::ECDSA_P256_SHA256_FIXED_SIGNING;
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(alg, &rng)
            .map_err(|_| anyhow::anyhow!("generating a P-256 key"))?;
        let key = EcdsaKeyPair::from_pkcs8(alg, pkcs8.as_ref(), &rng)
            .map_err(|_| anyhow::anyhow!("loading a P-256 key"))?;
        let token_input = vec![b'e'; token_len.max(1)];
        let token_sig = key
            .sign(&rng, &token_input)
            .map_err(|_| anyhow::anyhow!("signing"))?
            .as_ref()
            .to_vec();
        let token_public = key.public_key().as_ref().to_vec();
        Ok(Self {
            rng,
            key,
            signing_input: vec![b'e'; 250],
            token_input,
            token_sig,
            token_public,
        })
    }

    fn limits(&self) -> JwtLimits {
        let window = Duration::from_secs(1);
        let sign = per_second(window, || {
            std::hint::black_box(self.key.sign(&self.rng, &self.signing_input).is_ok());
        });
        let verify = per_second(window, || {
            let ok = signature::UnparsedPublicKey::new(
                &signature::ECDSA_P256_SHA256_FIXED,
                &self.token_public,
            )
            .verify(&self.token_input, &self.token_sig)
            .is_ok();
            std::hint::black_box(ok);
        });
        JwtLimits {
            full: 1.0 / (1.0 / sign + 1.0 / verify),
            sign_only: sign,
        }
    }

    /// JWT-SVIDs per second on this thread through meshca's in-process
    /// minting path (claims, base64url, signature) plus the token check.
    fn in_process_path(&self) -> anyhow::Result<f64> {
        let dir = tempfile::tempdir().context("a temporary directory")?;
        let issuer = meshca_ca::jwt_svid::StandaloneJwtIssuer::open(dir.path())?;
        let id = SpiffeId::parse("spiffe://cluster.local/ns/bench/sa/sa-0")?;
        let audiences = vec![AUDIENCE.to_string()];
        let mut failed = None;
        let rate = per_second(Duration::from_secs(2), || {
            if let Err(e) = issuer.mint(&id, &audiences) {
                failed = Some(e);
            }
            let ok = signature::UnparsedPublicKey::new(
                &signature::ECDSA_P256_SHA256_FIXED,
                &self.token_public,
            )
            .verify(&self.token_input, &self.token_sig)
            .is_ok();
            std::hint::black_box(ok);
        });
        match failed {
            Some(e) => anyhow::bail!("the in-process minting path failed: {e}"),
            None => Ok(rate),
        }
    }
}

/// `meshca-bench --jwt-svid`. `Ok(false)` when requests failed.
pub(crate) async fn run(args: RunArgs) -> anyhow::Result<bool> {
    eprintln!(
        "meshca-bench: JWT-SVIDs: preparing {} tokens…",
        args.identities
    );
    let prepared = Arc::new(prepare(&args)?);
    let clients = connect(&args).await?;
    // The length of a token's signing input (header.claims).
    let token_len = prepared
        .first()
        .and_then(|a| a.to_str().ok())
        .and_then(|a| a.strip_prefix("Bearer "))
        .and_then(|t| t.rsplit_once('.'))
        .map_or(600, |(input, _)| input.len());
    let yardstick = args
        .crypto_baseline
        .then(|| JwtYardstick::new(token_len))
        .transpose()?;
    let limit_before = yardstick.as_ref().map(JwtYardstick::limits);
    if !args.warmup.is_zero() {
        drive(
            &clients,
            &prepared,
            args.concurrency,
            Some(args.warmup),
            None,
        )
        .await;
    }
    let before = WindowEdge::read(args.server_pid);
    let driven = drive(
        &clients,
        &prepared,
        args.concurrency,
        args.requests.is_none().then_some(args.duration),
        args.requests,
    )
    .await;
    let after = WindowEdge::read(args.server_pid);
    let baseline = match (&yardstick, limit_before) {
        (Some(yardstick), Some(before)) => {
            let after = yardstick.limits();
            Some(Baseline {
                limit_per_core: (before.full + after.full) / 2.0,
                limit_before: before.full,
                limit_after: after.full,
                limit_without_token_per_core: Some((before.sign_only + after.sign_only) / 2.0),
                operations: "ES256 JWT-SVID sign + ES256 token verify".into(),
                in_process_path_per_core: yardstick.in_process_path()?,
            })
        }
        _ => None,
    };
    let mut setup = BTreeMap::new();
    setup.insert("target", json!("meshca MintJwtSvid"));
    setup.insert("addr", json!(args.addr));
    setup.insert("identities", json!(prepared.len()));
    setup.insert("connections", json!(clients.len()));
    setup.insert("concurrency", json!(args.concurrency));
    setup.insert("generator_threads", json!(args.threads));
    setup.insert(
        "auth",
        json!(if args.tokens.is_some() {
            "tokens-file"
        } else {
            "offline-jwt"
        }),
    );
    Ok(RunReport::of_window(setup, driven, before, after, baseline).print(args.json))
}
