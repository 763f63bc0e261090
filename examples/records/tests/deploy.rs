//! The container image, the compose file and the Kubernetes manifests name only what exists:
//! every command and subcommand parses, every `OUTPOST_*` variable is a configuration key with
//! a valid value, every port is the admin endpoint's, and every probe or scrape path answers on a
//! running node. The same checks, run on copies with one key or one path renamed, must complain.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use clap::Parser;
use serde_yaml_ng::Value;

fn repo_file(path: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// What the files ask of the binaries; problems are collected, not thrown.
#[derive(Debug, Default)]
struct Checks {
    problems: Vec<String>,
    /// (where, path) of every HTTP path probed or scraped on the admin port.
    paths: BTreeSet<(String, String)>,
}

impl Checks {
    fn problem(&mut self, p: String) {
        self.problems.push(p);
    }

    /// `argv` (binary first) parses as a command of that binary.
    fn command(&mut self, wheref: &str, argv: &[String]) {
        let Some(bin) = argv.first() else {
            return self.problem(format!("{wheref}: no command"));
        };
        let parsed = match bin.as_str() {
            "outpost" => outpost::cli::Cli::try_parse_from(argv).err(),
            "outpost-records" => outpost_records::cli::Cli::try_parse_from(argv).err(),
            other => {
                return self.problem(format!("{wheref}: runs {other:?}, not one of the binaries"));
            }
        };
        if let Some(e) = parsed {
            self.problem(format!(
                "{wheref}: `{}` does not parse: {e}",
                argv.join(" ")
            ));
        }
    }

    /// The variables are configuration keys with valid values; returns the admin port.
    fn env(&mut self, wheref: &str, vars: &BTreeMap<String, String>) -> Option<u16> {
        let outpost_vars: Vec<(String, String)> = vars
            .iter()
            .filter(|(k, _)| k.starts_with("OUTPOST_"))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let loaded = outpost::config::load(&outpost::config::LoadOptions {
            file: None,
            overrides: Vec::new(),
            env: true,
            env_vars: Some(outpost_vars),
        });
        match loaded {
            Ok(c) => match c.admin.listen_addr() {
                Ok(a) => Some(a.port()),
                Err(e) => {
                    self.problem(format!("{wheref}: admin.listen: {e}"));
                    None
                }
            },
            Err(e) => {
                self.problem(format!("{wheref}: {e}"));
                None
            }
        }
    }

    fn path(&mut self, wheref: &str, path: &str) {
        self.paths.insert((wheref.to_owned(), path.to_owned()));
    }
}

/// The Dockerfile's runtime stage: entrypoint, command, environment, exposed port, health check.
#[derive(Debug, Default)]
struct Image {
    entrypoint: Vec<String>,
    cmd: Vec<String>,
    env: BTreeMap<String, String>,
    expose: Vec<u16>,
    health_url: Option<String>,
}

fn json_array(s: &str) -> Vec<String> {
    serde_json::from_str(s.trim()).unwrap_or_else(|e| panic!("not exec form {s:?}: {e}"))
}

fn image(dockerfile: &str) -> Image {
    let mut img = Image::default();
    // Instructions with their continuation lines joined; only the last stage counts.
    let joined = dockerfile.replace("\\\n", " ");
    for line in joined.lines().map(str::trim) {
        let (instr, rest) = line.split_once(' ').unwrap_or((line, ""));
        match instr {
            "FROM" => img = Image::default(),
            "ENTRYPOINT" => img.entrypoint = json_array(rest),
            "CMD" => img.cmd = json_array(rest),
            "ENV" => {
                for kv in rest.split_whitespace() {
                    if let Some((k, v)) = kv.split_once('=') {
                        img.env.insert(k.to_owned(), v.to_owned());
                    }
                }
            }
            "EXPOSE" => img.expose.extend(
                rest.split_whitespace()
                    .filter_map(|p| p.parse::<u16>().ok()),
            ),
            "HEALTHCHECK" => {
                let cmd = rest
                    .split_once("CMD")
                    .map(|(_, c)| json_array(c))
                    .unwrap_or_default();
                img.health_url = cmd.into_iter().find(|a| a.starts_with("http://"));
            }
            _ => {}
        }
    }
    img
}

/// `http://host:port/path` → (port, path).
fn port_and_path(url: &str) -> (Option<u16>, String) {
    let rest = url.trim_start_matches("http://");
    let (hostport, path) = rest.split_once('/').unwrap_or((rest, ""));
    let port = hostport.rsplit_once(':').and_then(|(_, p)| p.parse().ok());
    (port, format!("/{path}"))
}

fn strings(v: Option<&Value>) -> Option<Vec<String>> {
    v?.as_sequence().map(|s| {
        s.iter()
            .map(|x| match x {
                Value::String(s) => s.clone(),
                other => serde_yaml_ng::to_string(other).unwrap().trim().to_owned(),
            })
            .collect()
    })
}

fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => serde_yaml_ng::to_string(other).unwrap().trim().to_owned(),
    }
}

fn check_image(checks: &mut Checks, img: &Image) {
    let mut argv = img.entrypoint.clone();
    argv.extend(img.cmd.iter().cloned());
    checks.command("Dockerfile ENTRYPOINT+CMD", &argv);
    let port = checks.env("Dockerfile ENV", &img.env);
    if port.is_some_and(|p| !img.expose.contains(&p)) {
        checks.problem(format!(
            "Dockerfile EXPOSE {:?} is not admin.listen's port {port:?}",
            img.expose
        ));
    }
    match &img.health_url {
        Some(url) => {
            let (hport, path) = port_and_path(url);
            if hport != port {
                checks.problem(format!(
                    "Dockerfile HEALTHCHECK port {hport:?} is not {port:?}"
                ));
            }
            checks.path("Dockerfile HEALTHCHECK", &path);
        }
        None => checks.problem("Dockerfile has no HEALTHCHECK URL".to_owned()),
    }
}

fn check_compose(checks: &mut Checks, img: &Image, compose: &str, prometheus: &str) {
    let mut doc: Value = serde_yaml_ng::from_str(compose).expect("compose.yaml parses");
    doc.apply_merge().expect("merge keys");
    let services = doc["services"].as_mapping().expect("services").clone();
    let names: BTreeSet<String> = services.keys().map(scalar).collect();
    let mut admin_ports: BTreeMap<String, u16> = BTreeMap::new();
    for (name, svc) in &services {
        let name = scalar(name);
        let wheref = format!("compose service {name}");
        for dep in svc["depends_on"]
            .as_mapping()
            .map(|m| m.keys().map(scalar).collect::<Vec<_>>())
            .unwrap_or_default()
        {
            if !names.contains(&dep) {
                checks.problem(format!("{wheref}: depends on unknown service {dep}"));
            }
        }
        if svc.get("build").is_none() && svc["image"].as_str() != Some("outpost:local") {
            continue; // PostgreSQL, Redis, Prometheus: not ours.
        }
        let argv: Vec<String> = strings(svc.get("entrypoint"))
            .unwrap_or_else(|| img.entrypoint.clone())
            .into_iter()
            .chain(strings(svc.get("command")).unwrap_or_else(|| img.cmd.clone()))
            .collect();
        checks.command(&wheref, &argv);
        let mut env = img.env.clone();
        if let Some(m) = svc["environment"].as_mapping() {
            for (k, v) in m {
                env.insert(scalar(k), scalar(v));
            }
        }
        let Some(port) = checks.env(&wheref, &env) else {
            continue;
        };
        for p in strings(svc.get("ports")).unwrap_or_default() {
            let container = p.rsplit(':').next().and_then(|c| c.parse::<u16>().ok());
            if container != Some(port) {
                checks.problem(format!(
                    "{wheref}: port {p} does not reach admin.listen's port {port}"
                ));
            }
        }
        if argv.get(1).map(String::as_str) == Some("run") {
            admin_ports.insert(name.clone(), port);
            let grace = svc["stop_grace_period"]
                .as_str()
                .and_then(|g| g.trim_end_matches('s').parse::<u64>().ok());
            let drain = env
                .get("OUTPOST_RELAY__SHUTDOWN_TIMEOUT_MS")
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(10_000);
            if grace.is_none_or(|g| g * 1000 <= drain) {
                checks.problem(format!("{wheref}: stop_grace_period {grace:?} s is not longer than the drain ({drain} ms)"));
            }
        }
    }
    // Prometheus scrapes the relay services on their admin port, and loads the alert rules.
    let prom: Value = serde_yaml_ng::from_str(prometheus).expect("prometheus.yml parses");
    for job in prom["scrape_configs"]
        .as_sequence()
        .cloned()
        .unwrap_or_default()
    {
        let path = job["metrics_path"]
            .as_str()
            .unwrap_or("/metrics")
            .to_owned();
        checks.path("prometheus metrics_path", &path);
        for sc in job["static_configs"]
            .as_sequence()
            .cloned()
            .unwrap_or_default()
        {
            for t in strings(sc.get("targets")).unwrap_or_default() {
                let (host, port) = t.split_once(':').unwrap_or((&t, ""));
                if admin_ports.get(host).map(u16::to_string).as_deref() != Some(port) {
                    checks.problem(format!(
                        "prometheus target {t}: no relay service {host} with admin port {port}"
                    ));
                }
            }
        }
    }
    let mounted = services
        .get("prometheus")
        .and_then(|p| strings(p.get("volumes")))
        .unwrap_or_default();
    for rules in strings(prom.get("rule_files")).unwrap_or_default() {
        match mounted
            .iter()
            .find(|v| v.split(':').nth(1) == Some(rules.as_str()))
        {
            Some(v) => {
                let host = v.split(':').next().unwrap_or_default();
                let file = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                    .join("../../docker")
                    .join(host);
                if !file.is_file() {
                    checks.problem(format!("prometheus rule file {host} does not exist"));
                }
            }
            None => checks.problem(format!("prometheus rule file {rules} is not mounted")),
        }
    }
}

fn check_kubernetes(checks: &mut Checks, files: &[(String, String)]) {
    let mut docs = Vec::new();
    for (name, text) in files {
        for d in serde_yaml_ng::Deserializer::from_str(text) {
            let v: Value = serde::Deserialize::deserialize(d).expect("manifest parses");
            docs.push((name.clone(), v));
        }
    }
    let kind = |v: &Value| v["kind"].as_str().unwrap_or_default().to_owned();
    // The variables a container gets from the ConfigMap and the Secret.
    let mut shared = BTreeMap::new();
    for (_, d) in docs
        .iter()
        .filter(|(_, d)| ["ConfigMap", "Secret"].contains(&kind(d).as_str()))
    {
        for field in ["data", "stringData"] {
            if let Some(m) = d[field].as_mapping() {
                for (k, v) in m {
                    shared.insert(scalar(k), scalar(v));
                }
            }
        }
    }
    let mut deployment_labels = Vec::new();
    for (file, d) in &docs {
        let k = kind(d);
        if k != "Deployment" && k != "Job" {
            continue;
        }
        if k == "Deployment" {
            deployment_labels.push(d["spec"]["template"]["metadata"]["labels"].clone());
        }
        let pod = &d["spec"]["template"]["spec"];
        for c in pod["containers"].as_sequence().cloned().unwrap_or_default() {
            let wheref = format!("{file} {k} container {}", scalar(&c["name"]));
            let mut argv = vec!["outpost".to_owned()];
            argv.extend(strings(c.get("args")).unwrap_or_default());
            checks.command(&wheref, &argv);
            let mut env = shared.clone();
            for e in c["env"].as_sequence().cloned().unwrap_or_default() {
                // A value from the pod (fieldRef) is some string at run time.
                let value = e
                    .get("value")
                    .map(scalar)
                    .unwrap_or_else(|| "pod-name".to_owned());
                env.insert(scalar(&e["name"]), value);
            }
            let Some(port) = checks.env(&wheref, &env) else {
                continue;
            };
            let named: BTreeMap<String, u16> = c["ports"]
                .as_sequence()
                .cloned()
                .unwrap_or_default()
                .iter()
                .map(|p| {
                    (
                        scalar(&p["name"]),
                        p["containerPort"].as_u64().unwrap_or(0) as u16,
                    )
                })
                .collect();
            if k == "Deployment" && named.get("admin") != Some(&port) {
                checks.problem(format!(
                    "{wheref}: containerPort admin {:?} is not admin.listen's port {port}",
                    named.get("admin")
                ));
            }
            for probe in ["livenessProbe", "readinessProbe", "startupProbe"] {
                let Some(get) = c.get(probe).and_then(|p| p.get("httpGet")) else {
                    continue;
                };
                let p = &get["port"];
                let probe_port = p
                    .as_u64()
                    .map(|n| n as u16)
                    .or_else(|| p.as_str().and_then(|n| named.get(n).copied()));
                if probe_port != Some(port) {
                    checks.problem(format!(
                        "{wheref}: {probe} port {p:?} is not the admin port {port}"
                    ));
                }
                checks.path(
                    &format!("{wheref} {probe}"),
                    get["path"].as_str().unwrap_or(""),
                );
            }
            if k == "Deployment" {
                let pause = strings(c["lifecycle"]["preStop"]["exec"].get("command"))
                    .and_then(|cmd| {
                        (cmd.first().map(String::as_str) == Some("sleep"))
                            .then(|| cmd.get(1)?.parse::<u64>().ok())
                            .flatten()
                    })
                    .unwrap_or(0);
                let drain_ms = env
                    .get("OUTPOST_RELAY__SHUTDOWN_TIMEOUT_MS")
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(10_000);
                let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap_or(30);
                if grace * 1000 <= pause * 1000 + drain_ms {
                    checks.problem(format!("{wheref}: terminationGracePeriodSeconds {grace} does not cover preStop {pause} s + drain {drain_ms} ms"));
                }
            }
        }
    }
    for (file, d) in docs
        .iter()
        .filter(|(_, d)| kind(d) == "PodDisruptionBudget")
    {
        let wanted = d["spec"]["selector"]["matchLabels"]
            .as_mapping()
            .cloned()
            .unwrap_or_default();
        let matches = deployment_labels
            .iter()
            .any(|labels| wanted.iter().all(|(k, v)| labels.get(k) == Some(v)));
        if wanted.is_empty() || !matches {
            checks.problem(format!(
                "{file}: the PodDisruptionBudget selects no Deployment's pods"
            ));
        }
    }
}

fn kubernetes_files() -> Vec<(String, String)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../deploy/kubernetes");
    let mut files: Vec<(String, String)> = std::fs::read_dir(&dir)
        .expect("deploy/kubernetes")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read_to_string(&p).expect("read"))
        })
        .collect();
    files.sort();
    files
}

/// All the checks, on the given texts.
fn run_checks(
    dockerfile: &str,
    compose: &str,
    prometheus: &str,
    kube: &[(String, String)],
) -> Checks {
    let mut checks = Checks::default();
    let img = image(dockerfile);
    check_image(&mut checks, &img);
    check_compose(&mut checks, &img, compose, prometheus);
    check_kubernetes(&mut checks, kube);
    checks
}

/// Starts a node on a fresh database and asks every path; returns the ones that do not answer.
async fn missing_paths(paths: &BTreeSet<(String, String)>) -> Vec<String> {
    let db = support::TestDb::new().await;
    let prefix = format!("t:deploy:{}:", support::unique());
    let config = outpost::config::load(&outpost::config::LoadOptions {
        file: None,
        overrides: [
            ("database.url", db.url.clone()),
            ("redis.url", support::redis_url()),
            ("redis.key_prefix", prefix),
            ("node.id", "deploy-check".to_owned()),
            ("admin.listen", "127.0.0.1:0".to_owned()),
        ]
        .map(|(k, v)| (k.to_owned(), v))
        .to_vec(),
        env: false,
        env_vars: None,
    })
    .expect("node configuration");
    let node = tokio::task::spawn_blocking(move || outpost::app::start(&config))
        .await
        .unwrap()
        .expect("node starts");
    let addr = node.admin_addr().to_string();
    let mut missing = Vec::new();
    for (wheref, path) in paths {
        let code = http_status(&addr, path).await;
        // 200, or 503 from /readyz before the node took its partitions: the path exists.
        if code != 200 && code != 503 {
            missing.push(format!("{wheref}: GET {path} answered {code}"));
        }
    }
    node.shutdown().await;
    missing
}

async fn http_status(addr: &str, path: &str) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
        return 0;
    };
    let _ = s
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await;
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf).await;
    String::from_utf8_lossy(&buf)
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn image_compose_and_manifests_name_only_what_exists() {
    let (dockerfile, compose, prometheus) = (
        repo_file("docker/Dockerfile"),
        repo_file("docker/compose.yaml"),
        repo_file("docker/prometheus.yml"),
    );
    let kube = kubernetes_files();
    let checks = run_checks(&dockerfile, &compose, &prometheus, &kube);
    assert!(
        checks.problems.is_empty(),
        "problems:\n{}",
        checks.problems.join("\n")
    );
    let probed: BTreeSet<&str> = checks.paths.iter().map(|(_, p)| p.as_str()).collect();
    assert_eq!(probed, BTreeSet::from(["/livez", "/metrics", "/readyz"]));
    let missing = missing_paths(&checks.paths).await;
    assert!(
        missing.is_empty(),
        "paths the node does not serve:\n{}",
        missing.join("\n")
    );

    // The same checks find a renamed key, command, port or path.
    let renamed_key = compose.replace(
        "OUTPOST_RELAY__SHUTDOWN_TIMEOUT_MS",
        "OUTPOST_RELAY__SHUTDOWN_MS",
    );
    let c = run_checks(&dockerfile, &renamed_key, &prometheus, &kube);
    assert!(
        c.problems.iter().any(|p| p.contains("relay.shutdown_ms")),
        "{:?}",
        c.problems
    );

    let renamed_cmd = compose.replace("[\"migrate\", \"up\"]", "[\"migrations\", \"up\"]");
    let c = run_checks(&dockerfile, &renamed_cmd, &prometheus, &kube);
    assert!(
        c.problems
            .iter()
            .any(|p| p.contains("compose service migrate")),
        "{:?}",
        c.problems
    );

    let kube_key: Vec<(String, String)> = kube
        .iter()
        .map(|(n, t)| {
            (
                n.clone(),
                t.replace("OUTPOST_NODE__LEASE_MS", "OUTPOST_NODE__LEASE"),
            )
        })
        .collect();
    let c = run_checks(&dockerfile, &compose, &prometheus, &kube_key);
    assert!(
        c.problems.iter().any(|p| p.contains("node.lease")),
        "{:?}",
        c.problems
    );

    let kube_port: Vec<(String, String)> = kube
        .iter()
        .map(|(n, t)| {
            (
                n.clone(),
                t.replace("containerPort: 9400", "containerPort: 9500"),
            )
        })
        .collect();
    let c = run_checks(&dockerfile, &compose, &prometheus, &kube_port);
    assert!(
        c.problems.iter().any(|p| p.contains("containerPort")),
        "{:?}",
        c.problems
    );

    let kube_path: Vec<(String, String)> = kube
        .iter()
        .map(|(n, t)| (n.clone(), t.replace("path: /readyz", "path: /ready")))
        .collect();
    let c = run_checks(&dockerfile, &compose, &prometheus, &kube_path);
    assert!(c.problems.is_empty(), "{:?}", c.problems);
    let missing = missing_paths(&c.paths).await;
    assert!(
        missing
            .iter()
            .any(|m| m.contains("GET /ready answered 404")),
        "{missing:?}"
    );
}
