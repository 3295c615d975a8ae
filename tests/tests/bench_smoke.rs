//! A small run of `meshca-bench` against the real `meshca`: a few hundred
//! requests over TLS with offline-JWT tokens must all succeed, and the JSON
//! report must carry the numbers scripts read. No timing is asserted:
//! performance lives in benchmarks (BENCHMARKS.md), not in tests.

#![allow(clippy::unwrap_used)]

use meshca_tests::*;

/// Runs `meshca-bench` with the arguments `args` adds; it must succeed,
/// and its output is the JSON report.
fn run_bench(
    args: impl FnOnce(&mut std::process::Command) -> &mut std::process::Command,
) -> serde_json::Value {
    let mut bench = std::process::Command::new(bench_binary());
    let out = args(&mut bench).output().unwrap();
    assert!(
        out.status.success(),
        "meshca-bench failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn a_few_hundred_requests_without_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = MeshcaServer::start(&data, &[]).unwrap();
    let pid = server.pid().to_string();
    let addr = format!("https://{}", server.grpc);
    let report = run_bench(|bench| {
        bench
            .args(["--addr", &addr, "--data-dir", data.to_str().unwrap()])
            .args([
                "--identities",
                "50",
                "--requests",
                "300",
                "--concurrency",
                "8",
                "--connections",
                "2",
            ])
            .args(["--warmup", "0s", "--server-pid", &pid, "--json"])
            .arg("--crypto-baseline")
    });
    assert_eq!(report["ok"], 300, "{report}");
    assert_eq!(report["errors"], serde_json::json!({}), "{report}");
    assert_eq!(report["setup"]["auth"], "offline-jwt");
    for key in ["p50", "p90", "p99", "max"] {
        assert!(
            report["latency_ms"][key].as_f64().unwrap() > 0.0,
            "{key}: {report}"
        );
    }
    assert!(
        report["server"]["peak_rss_mib"].as_f64().unwrap() > 1.0,
        "{report}"
    );
    assert!(report["throughput_per_second"].as_f64().unwrap() > 0.0);
    // The yardstick: with tokens, the limit with and without the token check.
    let baseline = &report["crypto_baseline"];
    let full = baseline["limit_per_core"].as_f64().unwrap();
    let without_token = baseline["limit_without_token_check_per_core"]
        .as_f64()
        .unwrap();
    assert!(full > 0.0 && without_token > full, "{report}");
    assert!(
        report["ratio_to_crypto_limit_without_token_check"]
            .as_f64()
            .unwrap()
            < report["ratio_to_crypto_limit_per_server_cpu_second"]
                .as_f64()
                .unwrap(),
        "{report}"
    );
    // 50 identities asked in turn: each token came back many times.
    assert!(
        report["token_repeats_every_seconds"].as_f64().unwrap() > 0.0,
        "{report}"
    );
    // The server issued exactly what the generator counted.
    let metrics = http_get(server.monitoring, "/metrics").unwrap().1;
    assert!(
        metrics.contains("\ncitadel_server_success_cert_issuance_count 300\n"),
        "{metrics}"
    );
}

#[test]
fn bad_flags_name_the_problem() {
    let out = std::process::Command::new(bench_binary())
        .args([
            "--addr",
            "https://127.0.0.1:1",
            "--root-cert",
            "/nonexistent/root.pem",
            "--requests",
            "1",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--root-cert /nonexistent/root.pem"),
        "{stderr}"
    );
}

#[test]
fn a_node_agent_gets_every_pod_on_its_node_with_one_token_review() {
    // `meshca-bench mass-restart` starts the `meshca` next to it (built by
    // `binaries()` into the same directory) against the fake API server.
    let meshca = &binaries().meshca;
    let run = |extra: &[&str]| {
        run_bench(|bench| {
            bench
                .args(["mass-restart", "--node-agent", "--identities", "40"])
                .args(["--connections", "4", "--api-latency", "1ms", "--json"])
                .args(extra)
                .arg("--meshca")
                .arg(meshca)
        })
    };
    let report = run(&[]);
    assert_eq!(report["scenario"], "mass-restart-node-agent", "{report}");
    assert_eq!(report["auth"], "token-review", "{report}");
    assert_eq!(report["ok"], 40, "{report}");
    assert_eq!(report["errors"], serde_json::json!({}), "{report}");
    // One token for all 40 pods: reviewed once, then from the cache.
    assert_eq!(report["token_reviews"], 1, "{report}");

    // The agent's token signed by the cluster and checked offline: no review.
    let report = run(&["--offline-jwt"]);
    assert_eq!(report["auth"], "offline-jwt", "{report}");
    assert_eq!(report["ok"], 40, "{report}");
    assert_eq!(report["errors"], serde_json::json!({}), "{report}");
    assert_eq!(report["token_reviews"], 0, "{report}");
}

#[test]
fn restarted_sidecars_each_open_their_own_connection() {
    // Every identity connects when the storm starts (TLS handshake
    // included), with its own token reviewed through the fake API server.
    let report = run_bench(|bench| {
        bench
            .args(["mass-restart", "--identities", "40", "--api-latency", "1ms"])
            .args(["--connection-per-identity", "--json", "--meshca"])
            .arg(&binaries().meshca)
    });
    assert_eq!(report["scenario"], "mass-restart", "{report}");
    assert_eq!(report["connected_in_storm"], true, "{report}");
    assert_eq!(report["connections"], 40, "{report}");
    assert_eq!(report["ok"], 40, "{report}");
    assert_eq!(report["errors"], serde_json::json!({}), "{report}");
    assert_eq!(report["token_reviews"], 40, "{report}");
}

#[test]
fn identities_of_two_clusters_are_each_reviewed_by_their_own_cluster() {
    // `--clusters 2`: two fake API servers, meshca's remote clusters
    // (`--remote-cluster`), each request naming its cluster in `clusterid`.
    let run = |extra: &[&str]| {
        run_bench(|bench| {
            bench
                .args(["mass-restart", "--clusters", "2", "--identities", "40"])
                .args(["--connections", "4", "--api-latency", "1ms", "--json"])
                .args(extra)
                .arg("--meshca")
                .arg(&binaries().meshca)
        })
    };
    let report = run(&[]);
    assert_eq!(report["clusters"], 2, "{report}");
    assert_eq!(report["ok"], 40, "{report}");
    assert_eq!(report["errors"], serde_json::json!({}), "{report}");
    assert_eq!(
        report["token_reviews_by_cluster"],
        serde_json::json!({"cluster-1": 20, "cluster-2": 20}),
        "{report}"
    );
    assert_eq!(report["token_reviews_local_cluster"], 0, "{report}");

    // A node agent in each cluster, judged on its own cluster's pods.
    let report = run(&["--node-agent"]);
    assert_eq!(report["ok"], 40, "{report}");
    assert_eq!(report["errors"], serde_json::json!({}), "{report}");
    assert_eq!(
        report["token_reviews_by_cluster"],
        serde_json::json!({"cluster-1": 1, "cluster-2": 1}),
        "{report}"
    );
}

#[test]
fn a_storm_against_the_real_api_server_counts_its_token_reviews() {
    // `--kube-apiserver`: the tests' etcd and kube-apiserver, real
    // ServiceAccounts and TokenRequest tokens; skipped (with a note) when
    // the control plane is not built.
    if !meshca_tests::control_plane::available() {
        return;
    }
    let report = run_bench(|bench| {
        bench
            .args(["mass-restart", "--kube-apiserver", "--identities", "40"])
            .args(["--connections", "4", "--json", "--meshca"])
            .arg(&binaries().meshca)
    });
    assert_eq!(report["api"], "kube-apiserver", "{report}");
    assert_eq!(report["ok"], 40, "{report}");
    assert_eq!(report["errors"], serde_json::json!({}), "{report}");
    // Counted by kube-apiserver itself: one review per distinct token.
    assert_eq!(report["token_reviews"], 40, "{report}");
    let api = &report["kube_apiserver"];
    assert_eq!(api["calls"]["POST tokenreviews 201"], 40, "{report}");
    assert!(
        api["version"].as_str().unwrap().starts_with("v1."),
        "{report}"
    );
}

#[test]
fn hostile_pods_on_a_node_agent_leave_the_well_behaved_pod_served() {
    // Two hostile pods (processes of their own, attributed to their pods
    // by the agent's fake --proc-root) for a short phase: the report's
    // numbers are there, and the well-behaved pod got its SVID, on fresh
    // connections and as rotations, alone and during the attack.
    // Exit 2 is a report whose real clients were not clean: judged below.
    let out = std::process::Command::new(bench_binary())
        .args(["hostile-pods", "--pods", "2", "--duration", "3s"])
        .args(["--workload-ttl", "2s", "--json", "--meshca"])
        .arg(&binaries().meshca)
        .arg("--meshca-agent")
        .arg(&binaries().meshca_agent)
        .output()
        .unwrap();
    assert!(
        matches!(out.status.code(), Some(0 | 2)),
        "meshca-bench failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["scenario"], "hostile-pods", "{report}");
    assert_eq!(report["real_clients_clean"], true, "{report}");
    let agent = &report["agent"];
    assert_eq!(agent["alive"], true, "{report}");
    for key in [
        "rss_start_mib",
        "rss_before_attack_mib",
        "rss_peak_mib",
        "rss_after_mib",
        "cpu_seconds_attacked",
    ] {
        assert!(agent[key].as_f64().unwrap() > 0.0, "{key}: {report}");
    }
    assert!(agent["log_lines_attacked"].is_u64(), "{report}");
    for phase in ["alone", "attacked"] {
        let good = &report["good_pod"][phase];
        assert_eq!(good["errors"], 0, "{phase}: {report}");
        assert!(
            good["svid_fetches"].as_u64().unwrap() > 0,
            "{phase}: {report}"
        );
        assert!(good["rotations"].as_u64().unwrap() > 0, "{phase}: {report}");
        assert!(
            good["svid_fetch_latency_ms"]["p99"].as_f64().unwrap() > 0.0,
            "{phase}: {report}"
        );
        assert!(
            good["rotation_delay_ms"]["max"].is_f64(),
            "{phase}: {report}"
        );
    }
    // The attacks ran, and the agent pushed back on them.
    let attacks = &report["attacks"];
    for key in [
        "parked_blocks_sent",
        "never_read_streams_opened",
        "sds_streams_opened",
        "split_streams_opened",
    ] {
        assert!(attacks[key].as_u64().unwrap() > 0, "{key}: {report}");
    }
    for goal in [
        "peak_rss_under_half_the_limit",
        "rss_back_within_8_mib",
        "no_added_delay_beyond_100_ms",
    ] {
        assert!(report["goals"][goal].is_boolean(), "{goal}: {report}");
    }
}
