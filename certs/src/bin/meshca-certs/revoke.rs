//! `meshca-certs revoke` and `meshca-certs revocations list`: the
//! operator's revocation list, in a data directory (`revocations.yaml`) or
//! in the ConfigMap `meshca-revocations` of meshca's namespace.
//!
//! The file is rewritten atomically (a temporary file renamed over it)
//! under an exclusive `flock` on `revocations.yaml.lock` beside it, so two
//! commands at once both keep their entry; the ConfigMap is updated with the `resourceVersion` read, and read again
//! when another writer came first, so no edit is lost. Entries that do not
//! parse are carried over as they are (and named on standard error).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, PostParams};
use meshca_certs::revocation::{
    IntermediateRef, Revocation, RevocationList, RevocationReason, RevocationTarget, Serial,
    CONFIGMAP_KEY, CONFIGMAP_NAME, REVOCATIONS_FILE,
};
use time::OffsetDateTime;

/// How often a ConfigMap update is tried again after another writer came
/// first (409 Conflict) before the command gives up.
const MAX_CONFLICT_RETRIES: usize = 10;
/// How long `revoke --data-dir` waits for another writer's lock.
const FILE_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(10);
/// The lock file beside `revocations.yaml` (the list itself is replaced by
/// a rename, so its own inode cannot carry the lock).
const FILE_LOCK: &str = "revocations.yaml.lock";
/// The namespace when `--namespace` is not given (where deploy/ puts meshca).
const DEFAULT_NAMESPACE: &str = "istio-system";

/// Where the list lives.
#[derive(Args, Debug, Clone)]
#[group(required = true, multiple = false)]
pub(crate) struct Store {
    /// meshca's data directory (the file revocations.yaml in it).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// A kubeconfig: the ConfigMap meshca-revocations in --namespace.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
}

/// What `revoke` revokes: exactly one.
#[derive(Args, Debug, Clone)]
#[group(required = true, multiple = false)]
pub(crate) struct Target {
    /// A certificate's serial (hex, colons allowed).
    #[arg(long)]
    serial: Option<String>,
    /// Every certificate of a SPIFFE ID.
    #[arg(long)]
    spiffe_id: Option<String>,
    /// Every certificate of a service account, NAMESPACE/NAME.
    #[arg(long)]
    service_account: Option<String>,
    /// Every certificate issued for pods of a node (node agents included).
    #[arg(long)]
    node: Option<String>,
    /// An intermediate CA (its PEM certificate): every leaf under it.
    #[arg(long, value_name = "PEMFILE")]
    intermediate: Option<PathBuf>,
}

/// `meshca-certs revoke`.
#[derive(Args, Debug)]
pub(crate) struct RevokeArgs {
    #[command(flatten)]
    target: Target,
    /// Why (RFC 5280's reasons: unspecified, keyCompromise, cACompromise,
    /// affiliationChanged, superseded, cessationOfOperation,
    /// privilegeWithdrawn). Recorded, never told to callers.
    #[arg(long, default_value = "unspecified")]
    reason: String,
    /// The entry stops refusing new certificates after this long (e.g.
    /// 7d); what it revoked stays in the CRL until it expires.
    #[arg(long, value_parser = meshca_certs::parse_duration)]
    expires_in: Option<std::time::Duration>,
    #[command(flatten)]
    store: Store,
    /// meshca's namespace (with --kubeconfig).
    #[arg(long, default_value = DEFAULT_NAMESPACE)]
    namespace: String,
}

/// `meshca-certs revocations list`.
#[derive(Args, Debug)]
pub(crate) struct ListArgs {
    #[command(flatten)]
    store: Store,
    /// meshca's namespace (with --kubeconfig).
    #[arg(long, default_value = DEFAULT_NAMESPACE)]
    namespace: String,
    /// Print JSON for scripts.
    #[arg(long)]
    json: bool,
}

fn target_of(t: &Target) -> anyhow::Result<RevocationTarget> {
    Ok(if let Some(s) = &t.serial {
        RevocationTarget::Serial(Serial::parse(s).context("--serial")?)
    } else if let Some(id) = &t.spiffe_id {
        RevocationTarget::spiffe_id(id).context("--spiffe-id")?
    } else if let Some(sa) = &t.service_account {
        RevocationTarget::service_account(sa).context("--service-account")?
    } else if let Some(node) = &t.node {
        RevocationTarget::node(node).context("--node")?
    } else if let Some(path) = &t.intermediate {
        let pem = std::fs::read_to_string(path)
            .with_context(|| format!("--intermediate: reading {}", path.display()))?;
        RevocationTarget::Intermediate(
            IntermediateRef::from_pem(&pem)
                .with_context(|| format!("--intermediate {}", path.display()))?,
        )
    } else {
        bail!("give one of --serial, --spiffe-id, --service-account, --node, --intermediate");
    })
}

fn warn_rejected(list: &RevocationList, source: &str) {
    for rejected in list.rejected() {
        eprintln!("meshca-certs: warning: {source}: {rejected} (kept as it is; meshca ignores it)");
    }
}

/// Runs `revoke`.
pub(crate) fn revoke(args: RevokeArgs) -> anyhow::Result<()> {
    let now = OffsetDateTime::now_utc();
    let reason = RevocationReason::parse(&args.reason).context("--reason")?;
    let mut entry = Revocation::new(target_of(&args.target)?, reason, now);
    if let Some(d) = args.expires_in {
        let d = time::Duration::try_from(d).context("--expires-in")?;
        entry.expires = Some(entry.revoked_at + d);
    }
    let name = entry.name();
    let added = match (&args.store.data_dir, &args.store.kubeconfig) {
        (Some(dir), _) => edit_file(dir, entry, now)?,
        (None, Some(kubeconfig)) => {
            runtime()?.block_on(edit_configmap(kubeconfig, &args.namespace, entry, now))?
        }
        (None, None) => bail!("give --data-dir or --kubeconfig"),
    };
    if added {
        println!("revoked {name}");
    } else {
        println!("already revoked: {}", name_of_target(&name));
    }
    Ok(())
}

fn name_of_target(name: &str) -> &str {
    name.split(" (revoked at").next().unwrap_or(name)
}

fn edit_file(dir: &Path, entry: Revocation, now: OffsetDateTime) -> anyhow::Result<bool> {
    if !dir.is_dir() {
        bail!("--data-dir {}: not a directory", dir.display());
    }
    let path = dir.join(REVOCATIONS_FILE);
    // Read, add and write under the lock: another `revoke` at the same
    // moment waits, then reads the list with this entry in it.
    let _lock = lock_file(&dir.join(FILE_LOCK), FILE_LOCK_WAIT)?;
    let mut list = RevocationList::read_file(&path)
        .with_context(|| format!("{}: fix or move it away first", path.display()))?;
    warn_rejected(&list, &path.display().to_string());
    let added = list.add(entry, now)?;
    if added {
        list.write_file(&path)?;
    }
    Ok(added)
}

/// Takes an exclusive `flock` on `path` (created if missing), waiting up
/// to `wait` for another writer; held until the file is dropped.
fn lock_file(path: &Path, wait: std::time::Duration) -> anyhow::Result<std::fs::File> {
    use rustix::fs::{flock, FlockOperation};
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .with_context(|| format!("opening the lock file {}", path.display()))?;
    let deadline = std::time::Instant::now() + wait;
    loop {
        match flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => return Ok(file),
            Err(rustix::io::Errno::WOULDBLOCK) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            Err(rustix::io::Errno::WOULDBLOCK) => bail!(
                "{} is held by another writer for more than {wait:?}; try again",
                path.display()
            ),
            Err(e) => {
                return Err(std::io::Error::from(e))
                    .with_context(|| format!("locking {}", path.display()))
            }
        }
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

async fn client(kubeconfig: &Path) -> anyhow::Result<kube::Client> {
    let file = kube::config::Kubeconfig::read_from(kubeconfig)
        .with_context(|| format!("--kubeconfig {}", kubeconfig.display()))?;
    let config =
        kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
            .await
            .with_context(|| format!("--kubeconfig {}", kubeconfig.display()))?;
    kube::Client::try_from(config).context("the Kubernetes client")
}

fn list_of(cm: &ConfigMap, source: &str) -> anyhow::Result<RevocationList> {
    let text = cm
        .data
        .as_ref()
        .and_then(|d| d.get(CONFIGMAP_KEY))
        .map(String::as_str)
        .unwrap_or("");
    RevocationList::parse(text, source).with_context(|| format!("{source}: fix it first"))
}

async fn edit_configmap(
    kubeconfig: &Path,
    namespace: &str,
    entry: Revocation,
    now: OffsetDateTime,
) -> anyhow::Result<bool> {
    let api: Api<ConfigMap> = Api::namespaced(client(kubeconfig).await?, namespace);
    let source = format!("configmap {namespace}/{CONFIGMAP_NAME}");
    for _ in 0..MAX_CONFLICT_RETRIES {
        let current = api
            .get_opt(CONFIGMAP_NAME)
            .await
            .with_context(|| format!("reading {source}"))?;
        let result = match current {
            None => {
                let mut list = RevocationList::new();
                list.add(entry.clone(), now)?;
                let cm = ConfigMap {
                    metadata: kube::api::ObjectMeta {
                        name: Some(CONFIGMAP_NAME.into()),
                        namespace: Some(namespace.into()),
                        ..Default::default()
                    },
                    data: Some([(CONFIGMAP_KEY.to_string(), list.to_yaml())].into()),
                    ..Default::default()
                };
                api.create(&PostParams::default(), &cm).await.map(|_| true)
            }
            Some(mut cm) => {
                let mut list = list_of(&cm, &source)?;
                warn_rejected(&list, &source);
                if !list.add(entry.clone(), now)? {
                    return Ok(false);
                }
                // The resourceVersion read stays in the object: the update
                // fails with 409 if another writer came in between.
                cm.data
                    .get_or_insert_with(Default::default)
                    .insert(CONFIGMAP_KEY.into(), list.to_yaml());
                api.replace(CONFIGMAP_NAME, &PostParams::default(), &cm)
                    .await
                    .map(|_| true)
            }
        };
        match result {
            Ok(added) => return Ok(added),
            Err(kube::Error::Api(status)) if status.code == 409 => continue,
            Err(e) => return Err(e).with_context(|| format!("writing {source}")),
        }
    }
    bail!("{source}: changed by another writer {MAX_CONFLICT_RETRIES} times in a row; try again")
}

/// Runs `revocations list`.
pub(crate) fn list(args: ListArgs) -> anyhow::Result<()> {
    let (list, source) = match (&args.store.data_dir, &args.store.kubeconfig) {
        (Some(dir), _) => {
            let path = dir.join(REVOCATIONS_FILE);
            (
                RevocationList::read_file(&path)?,
                path.display().to_string(),
            )
        }
        (None, Some(kubeconfig)) => {
            let source = format!("configmap {}/{CONFIGMAP_NAME}", args.namespace);
            let cm = runtime()?.block_on(async {
                let api: Api<ConfigMap> =
                    Api::namespaced(client(kubeconfig).await?, &args.namespace);
                api.get_opt(CONFIGMAP_NAME)
                    .await
                    .with_context(|| format!("reading {source}"))
            })?;
            let list = match cm {
                Some(cm) => list_of(&cm, &source)?,
                None => RevocationList::new(),
            };
            (list, source)
        }
        (None, None) => bail!("give --data-dir or --kubeconfig"),
    };
    if args.json {
        println!("{:#}", list.to_json());
        return Ok(());
    }
    let now = OffsetDateTime::now_utc();
    println!("{source}: {} entries", list.entries().len());
    for e in list.entries() {
        let state = if e.is_active(now) { "" } else { " (expired)" };
        let expires = e
            .expires
            .map(|x| format!(" expires {}", meshca_certs::Rfc3339(x)))
            .unwrap_or_default();
        println!("  {} reason {}{expires}{state}", e.name(), e.reason);
    }
    for r in list.rejected() {
        println!("  rejected {r}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sixteen `revoke --data-dir` at once: every entry is kept (without
    /// the lock, a read-modify-write between another's read and write lost
    /// entries).
    #[test]
    fn concurrent_edits_of_the_file_all_stay() {
        let dir = tempfile::tempdir().unwrap();
        let now = OffsetDateTime::now_utc();
        let threads: Vec<_> = (0..16u32)
            .map(|i| {
                let dir = dir.path().to_path_buf();
                std::thread::spawn(move || {
                    let serial = Serial::parse(&format!("{:x}", 0x1000 + i)).unwrap();
                    let entry = Revocation::new(
                        RevocationTarget::Serial(serial),
                        RevocationReason::KeyCompromise,
                        now,
                    );
                    edit_file(&dir, entry, now).unwrap()
                })
            })
            .collect();
        for t in threads {
            assert!(t.join().unwrap(), "each entry is new");
        }
        let list = RevocationList::read_file(&dir.path().join(REVOCATIONS_FILE)).unwrap();
        assert_eq!(list.entries().len(), 16);
        assert!(list.rejected().is_empty());
    }
}
