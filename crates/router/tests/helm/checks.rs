//! The checks every render passes: types, hardening, and names, ports, labels and
//! selectors lining up between objects.

use super::*;

/// `o` deserializes into `T`, and nothing of it is lost on the way: `k8s-openapi` types
/// ignore fields they do not know, so a misspelt or misplaced key (or a null where an
/// object belongs) would pass a plain deserialization; serialized back, it is missing.
fn exact<T: serde::de::DeserializeOwned + serde::Serialize>(o: &Value) {
    let back = serde_json::to_value(typed::<T>(o)).unwrap();
    nothing_lost(o, &back, &format!("{} {}", o["kind"], name(o)));
}

fn nothing_lost(orig: &Value, back: &Value, at: &str) {
    match orig {
        Value::Object(m) => {
            for (k, v) in m {
                let b = back
                    .get(k)
                    .unwrap_or_else(|| panic!("{at}.{k} is not a field of its type (or is null)"));
                nothing_lost(v, b, &format!("{at}.{k}"));
            }
        }
        Value::Array(items) => {
            let b = back.as_array().unwrap_or_else(|| panic!("{at} is no list"));
            assert_eq!(items.len(), b.len(), "{at}");
            for (i, (v, w)) in items.iter().zip(b).enumerate() {
                nothing_lost(v, w, &format!("{at}[{i}]"));
            }
        }
        Value::Null => assert!(!back.is_null() || at.is_empty(), "{at} is null"),
        // Scalars: a quantity or a port may come back as a string.
        _ => {}
    }
}

/// Every object parses as its type; the CRDs have what their schemas require.
pub fn check_all_typed(objs: &[Value]) {
    let mut seen = BTreeSet::new();
    for o in objs {
        assert!(
            seen.insert((o["kind"].to_string(), name(o).to_string())),
            "{} {} rendered twice",
            o["kind"],
            name(o)
        );
        assert_eq!(o["metadata"]["namespace"], NS, "{}", name(o));
        assert!(name(o).len() <= 63, "{} is too long for a name", name(o));
        match o["kind"].as_str().unwrap() {
            "Deployment" => exact::<Deployment>(o),
            "StatefulSet" => exact::<StatefulSet>(o),
            "Service" => exact::<Service>(o),
            "ServiceAccount" => exact::<ServiceAccount>(o),
            "ConfigMap" => exact::<ConfigMap>(o),
            "Secret" => exact::<Secret>(o),
            "Role" => exact::<Role>(o),
            "RoleBinding" => exact::<RoleBinding>(o),
            "PodDisruptionBudget" => exact::<PodDisruptionBudget>(o),
            "NetworkPolicy" => exact::<NetworkPolicy>(o),
            "InferencePool" => {
                assert_eq!(o["apiVersion"], "inference.networking.k8s.io/v1");
                let sel = o["spec"]["selector"]["matchLabels"].as_object().unwrap();
                assert!(!sel.is_empty());
                let ports = o["spec"]["targetPorts"].as_array().unwrap();
                assert!((1..=8).contains(&ports.len()));
                for p in ports {
                    assert!(p["number"]
                        .as_i64()
                        .is_some_and(|n| (1..=65535).contains(&n)));
                }
            }
            "HTTPRoute" | "Gateway" => {
                assert_eq!(o["apiVersion"], "gateway.networking.k8s.io/v1")
            }
            "ScaledObject" => {
                assert_eq!(o["apiVersion"], "keda.sh/v1alpha1");
                assert!(o["spec"]["scaleTargetRef"]["name"].is_string());
                let (min, max) = (
                    o["spec"]["minReplicaCount"].as_i64().unwrap(),
                    o["spec"]["maxReplicaCount"].as_i64().unwrap(),
                );
                assert!(0 <= min && min <= max, "replica bounds {min}..{max}");
            }
            "ServiceMonitor" => {
                assert_eq!(o["apiVersion"], "monitoring.coreos.com/v1");
                let eps = o["spec"]["endpoints"].as_array().unwrap();
                assert!(!eps.is_empty());
                for e in eps {
                    assert!(e["port"].is_string(), "ServiceMonitor ports are named");
                }
            }
            "Certificate" => {
                assert_eq!(o["apiVersion"], "cert-manager.io/v1");
                assert!(o["spec"]["secretName"].is_string());
                assert!(!o["spec"]["dnsNames"].as_array().unwrap().is_empty());
                assert!(o["spec"]["issuerRef"]["name"].is_string());
            }
            "LeaderWorkerSet" => {
                assert_eq!(o["apiVersion"], "leaderworkerset.x-k8s.io/v1");
                let t = &o["spec"]["leaderWorkerTemplate"];
                assert!(t["size"].as_i64().unwrap() >= 1);
                for which in ["leaderTemplate", "workerTemplate"] {
                    let back = serde_json::to_value(typed::<PodTemplateSpec>(&t[which])).unwrap();
                    nothing_lost(
                        &t[which],
                        &back,
                        &format!("LeaderWorkerSet {} {which}", name(o)),
                    );
                }
            }
            other => panic!("unexpected kind {other} rendered"),
        }
    }
}

pub fn probe_port_ok(p: &Probe, c: &Container) -> bool {
    let names: Vec<String> = c
        .ports
        .clone()
        .unwrap_or_default()
        .into_iter()
        .filter_map(|p| p.name)
        .collect();
    let numbers: Vec<i32> = c
        .ports
        .clone()
        .unwrap_or_default()
        .iter()
        .map(|p| p.container_port)
        .collect();
    if let Some(h) = &p.http_get {
        return match &h.port {
            IntOrString::String(s) => names.contains(s),
            IntOrString::Int(n) => numbers.contains(n),
        };
    }
    if let Some(g) = &p.grpc {
        return numbers.contains(&g.port);
    }
    p.exec
        .as_ref()
        .is_some_and(|e| !e.command.as_ref().unwrap().is_empty())
}

/// Every pod and container: non-root uid 65532, read-only root, no escalation, no
/// capabilities; readiness and liveness probes on a port it serves; resource requests;
/// each mount a volume of the pod, and something writable for what the process writes.
pub fn check_pods_hardened(pods: &[Pods]) {
    assert!(!pods.is_empty());
    for p in pods {
        let spec = p.spec();
        let psc = spec
            .security_context
            .as_ref()
            .unwrap_or_else(|| panic!("{}: no pod securityContext", p.owner));
        assert_eq!(psc.run_as_non_root, Some(true), "{}", p.owner);
        assert_eq!(psc.run_as_user, Some(UID), "{}", p.owner);
        assert_eq!(psc.fs_group, Some(UID), "{}", p.owner);
        let volumes: BTreeSet<String> = spec
            .volumes
            .clone()
            .unwrap_or_default()
            .into_iter()
            .map(|v| {
                assert!(
                    v.empty_dir.is_some()
                        || v.config_map.is_some()
                        || v.secret.is_some()
                        || v.persistent_volume_claim.is_some()
                        || v.csi.as_ref().is_some_and(|c| c.read_only == Some(true)),
                    "{}: volume {} has no source",
                    p.owner,
                    v.name
                );
                v.name
            })
            .collect();
        for c in spec
            .containers
            .iter()
            .chain(spec.init_containers.iter().flatten())
        {
            let at = format!("{} container {}", p.owner, c.name);
            let sc = c
                .security_context
                .as_ref()
                .unwrap_or_else(|| panic!("{at}: no securityContext"));
            assert_eq!(sc.allow_privilege_escalation, Some(false), "{at}");
            assert_eq!(sc.read_only_root_filesystem, Some(true), "{at}");
            assert_eq!(sc.run_as_non_root, Some(true), "{at}");
            assert_eq!(sc.run_as_user, Some(UID), "{at}");
            assert_eq!(sc.privileged, None, "{at}");
            let drop = sc
                .capabilities
                .as_ref()
                .and_then(|c| c.drop.clone())
                .unwrap_or_default();
            assert_eq!(drop, vec!["ALL".to_string()], "{at}: capabilities");
            assert!(
                sc.capabilities.as_ref().unwrap().add.is_none(),
                "{at}: adds capabilities"
            );
            for (kind, probe) in [
                ("readiness", &c.readiness_probe),
                ("liveness", &c.liveness_probe),
            ] {
                let probe = probe
                    .as_ref()
                    .unwrap_or_else(|| panic!("{at}: no {kind} probe"));
                assert!(
                    probe_port_ok(probe, c),
                    "{at}: {kind} probe port not served"
                );
            }
            let requests = c
                .resources
                .as_ref()
                .and_then(|r| r.requests.clone())
                .unwrap_or_default();
            assert!(
                requests.contains_key("cpu") && requests.contains_key("memory"),
                "{at}: cpu and memory requests"
            );
            let mounts = c.volume_mounts.clone().unwrap_or_default();
            for m in &mounts {
                assert!(
                    volumes.contains(&m.name) || p.claims.contains(&m.name),
                    "{at}: mount {} names no volume",
                    m.name
                );
            }
            assert!(
                mounts.iter().any(|m| m.mount_path == "/tmp"),
                "{at}: /tmp must be writable"
            );
        }
    }
}

/// A Service: its selector picks rendered pods, and each port's named target is a
/// container port there. Returns the selected pods.
pub fn check_service<'a>(svc: &Service, pods: &'a [Pods]) -> Vec<&'a Pods> {
    let n = svc.metadata.name.clone().unwrap();
    let spec = svc.spec.as_ref().unwrap();
    let sel = spec.selector.clone().unwrap_or_default();
    let chosen = selected(pods, &sel);
    assert!(!chosen.is_empty(), "Service {n} selects no rendered pods");
    for port in spec.ports.as_ref().unwrap() {
        let target = match port.target_port.as_ref() {
            Some(IntOrString::String(s)) => s.clone(),
            other => panic!("Service {n}: named target ports expected, got {other:?}"),
        };
        for p in &chosen {
            assert!(
                p.port_named(&target).is_some(),
                "Service {n} port {} targets {target}, which {} does not serve",
                port.port,
                p.owner
            );
        }
    }
    chosen
}

/// Pools, pickers and routes: each pool selects rendered engine pods on the port they
/// serve; its picker's Service reaches a picker whose flags name that pool; each route
/// sends to rendered pools and attaches to the rendered (or named) Gateway.
pub fn check_pools_and_routes(objs: &[Value], pods: &[Pods]) {
    for pool in of_kind(objs, "InferencePool") {
        let pname = name(pool);
        let sel = json_labels(&pool["spec"]["selector"]["matchLabels"]);
        let engines = selected(pods, &sel);
        assert!(!engines.is_empty(), "pool {pname} selects no rendered pods");
        let target = pool["spec"]["targetPorts"][0]["number"].as_i64().unwrap() as i32;
        for e in &engines {
            assert_eq!(
                e.port_named("http"),
                Some(target),
                "pool {pname}: {}",
                e.owner
            );
            let labels = e.labels();
            assert!(labels.contains_key("inference.networking.k8s.io/engine-type"));
        }
        let epr = &pool["spec"]["endpointPickerRef"];
        if epr.is_null() {
            continue;
        }
        assert_eq!(epr["kind"], "Service");
        let svc: Service = typed(find(objs, "Service", epr["name"].as_str().unwrap()));
        let port = epr["port"]["number"].as_i64().unwrap() as i32;
        let target_name = service_port(&svc, port)
            .unwrap_or_else(|| panic!("pool {pname}: picker Service lacks port {port}"));
        let pickers = check_service(&svc, pods);
        for p in pickers {
            assert_eq!(p.port_named(&target_name), Some(port));
            let epp = p
                .spec()
                .containers
                .iter()
                .find(|c| c.name == "epp")
                .unwrap();
            let args = router_args(epp);
            assert_eq!(args.pool_name.as_deref(), Some(pname), "{}", p.owner);
            assert_eq!(args.pool_namespace, NS);
            assert_eq!(args.ext_proc_port.map(i32::from), Some(port));
            // The picker's RBAC lets it read the pool and watch pods.
            let sa = p.spec().service_account_name.clone().unwrap();
            let binding: RoleBinding = typed(find(objs, "RoleBinding", &sa));
            assert_eq!(binding.subjects.unwrap()[0].name, sa);
            let role: Role = typed(find(objs, "Role", &binding.role_ref.name));
            let rules = role.rules.unwrap();
            for res in ["inferencepools", "pods"] {
                assert!(
                    rules.iter().any(|r| r
                        .resources
                        .as_ref()
                        .is_some_and(|rs| rs.iter().any(|x| x == res))
                        && r.verbs.iter().any(|v| v == "watch")),
                    "{sa} may not watch {res}"
                );
            }
            // The ConfigMap mounted as --config is rendered.
            let cm = p
                .spec()
                .volumes
                .as_ref()
                .unwrap()
                .iter()
                .find_map(|v| v.config_map.as_ref())
                .unwrap();
            find(objs, "ConfigMap", &cm.name);
        }
    }
    for route in of_kind(objs, "HTTPRoute") {
        let parent = route["spec"]["parentRefs"][0]["name"].as_str().unwrap();
        let gateways: Vec<&str> = of_kind(objs, "Gateway").map(name).collect();
        assert!(
            gateways.contains(&parent) || (gateways.is_empty() && parent == "shared-gateway"),
            "route {} attaches to {parent}, not a rendered Gateway",
            name(route)
        );
        for rule in route["spec"]["rules"].as_array().unwrap() {
            for b in rule["backendRefs"].as_array().unwrap() {
                assert_eq!(b["kind"], "InferencePool");
                assert_eq!(b["group"], "inference.networking.k8s.io");
                find(objs, "InferencePool", b["name"].as_str().unwrap());
            }
        }
    }
}

/// Every Service selects rendered pods on ports they serve; every ServiceMonitor selects
/// rendered Services that have its port; every PodDisruptionBudget selects rendered pods.
pub fn check_services_monitors_pdbs(objs: &[Value], pods: &[Pods]) {
    let services: Vec<Service> = of_kind(objs, "Service").map(typed).collect();
    for s in &services {
        check_service(s, pods);
    }
    for sm in of_kind(objs, "ServiceMonitor") {
        let sel = json_labels(&sm["spec"]["selector"]["matchLabels"]);
        let port = sm["spec"]["endpoints"][0]["port"].as_str().unwrap();
        let chosen: Vec<&Service> = services
            .iter()
            .filter(|s| subset(&sel, &s.metadata.labels.clone().unwrap_or_default()))
            .collect();
        assert!(
            !chosen.is_empty(),
            "ServiceMonitor {} selects no Service",
            name(sm)
        );
        for s in chosen {
            assert!(
                s.spec
                    .as_ref()
                    .unwrap()
                    .ports
                    .as_ref()
                    .unwrap()
                    .iter()
                    .any(|p| p.name.as_deref() == Some(port)),
                "ServiceMonitor {}: Service {:?} has no port {port}",
                name(sm),
                s.metadata.name
            );
        }
    }
    for pdb in of_kind(objs, "PodDisruptionBudget") {
        let p: PodDisruptionBudget = typed(pdb);
        let spec = p.spec.unwrap();
        let sel = match_labels(spec.selector.as_ref().unwrap());
        assert!(
            !selected(pods, &sel).is_empty(),
            "PDB {} selects no pods",
            name(pdb)
        );
        assert!(spec.max_unavailable.is_some() || spec.min_available.is_some());
    }
}

/// NetworkPolicies: each selects rendered pods; each in-namespace peer is rendered pods;
/// each named port is served by the pods the policy protects. Engines admit their picker
/// and their controller and nothing in the namespace besides them and their P/D peers.
pub fn check_network_policies(objs: &[Value], pods: &[Pods]) {
    for o in of_kind(objs, "NetworkPolicy") {
        let np: NetworkPolicy = typed(o);
        let n = name(o);
        let spec = np.spec.unwrap();
        assert_eq!(
            spec.policy_types.as_deref(),
            Some(&["Ingress".to_string()][..])
        );
        let guarded = selected(pods, &match_labels(spec.pod_selector.as_ref().unwrap()));
        assert!(!guarded.is_empty(), "NetworkPolicy {n} selects no pods");
        let mut peers: Vec<NetworkPolicyPeer> = Vec::new();
        for rule in spec.ingress.clone().unwrap_or_default() {
            for port in rule.ports.clone().unwrap_or_default() {
                if let Some(IntOrString::String(pn)) = port.port {
                    for g in &guarded {
                        assert!(
                            g.port_named(&pn).is_some(),
                            "NetworkPolicy {n} opens port {pn}, which {} does not serve",
                            g.owner
                        );
                    }
                }
            }
            let from = rule.from.clone().unwrap_or_default();
            assert!(!from.is_empty(), "{n}: a rule open to all");
            for peer in from {
                if peer.namespace_selector.is_none() {
                    let sel = match_labels(peer.pod_selector.as_ref().unwrap());
                    assert!(
                        !selected(pods, &sel).is_empty(),
                        "NetworkPolicy {n}: peer {sel:?} is no rendered pod"
                    );
                }
                peers.push(peer);
            }
        }
        // The engines' policy: in the namespace, only their picker, their controller and
        // their own pods (P/D, LeaderWorkerSet groups) get in.
        if n.ends_with("-engine") {
            let picker = n.trim_end_matches("-engine").to_string() + "-epp";
            let controller = n.trim_end_matches("-engine").to_string() + "-controller";
            // And a controller whose rollout API judges these pods (a canary's baseline).
            let judges = rollout_controllers_of(objs, n);
            for peer in peers.iter().filter(|p| p.namespace_selector.is_none()) {
                let who = match_labels(peer.pod_selector.as_ref().unwrap())
                    ["app.kubernetes.io/name"]
                    .clone();
                assert!(
                    who == picker || who == controller || who == n || judges.contains(&who),
                    "engines {n} admit {who}"
                );
            }
            if objs
                .iter()
                .any(|o| o["kind"] == "Deployment" && name(o) == picker)
            {
                assert!(
                    peers
                        .iter()
                        .any(|p| p.pod_selector.as_ref().is_some_and(|s| {
                            match_labels(s).get("app.kubernetes.io/name") == Some(&picker)
                        })),
                    "{n} must admit its picker {picker}"
                );
            }
        }
    }
}

/// The keys docs/GATEWAY.md documents for `gateway.yaml`: its full example, parsed.
pub fn documented_gateway_schema() -> serde_yaml::Value {
    let doc = std::fs::read_to_string(repo().join("docs/GATEWAY.md")).unwrap();
    let start = doc
        .find("## `gateway.yaml`")
        .expect("GATEWAY.md documents gateway.yaml");
    let rest = &doc[start..];
    let open = rest.find("```yaml\n").unwrap() + "```yaml\n".len();
    let close = rest[open..].find("```").unwrap();
    serde_yaml::from_str(&rest[open..open + close]).expect("the documented example parses")
}

/// Every key of `v` is a key the documented example has at the same place (lists: any
/// documented element has it).
pub fn keys_documented(v: &serde_yaml::Value, doc: &serde_yaml::Value, at: &str) {
    use serde_yaml::Value as Y;
    match (v, doc) {
        (Y::Mapping(m), Y::Mapping(d)) => {
            for (k, val) in m {
                let key = k.as_str().unwrap();
                let dv = d.get(key).unwrap_or_else(|| {
                    panic!("gateway.yaml key {at}.{key} is not in docs/GATEWAY.md")
                });
                keys_documented(val, dv, &format!("{at}.{key}"));
            }
        }
        (Y::Sequence(items), Y::Sequence(docs)) => {
            // Merge the documented elements' keys.
            let mut merged = serde_yaml::Mapping::new();
            for d in docs {
                if let Y::Mapping(dm) = d {
                    for (k, val) in dm {
                        merged.entry(k.clone()).or_insert(val.clone());
                    }
                }
            }
            for item in items {
                if item.is_mapping() {
                    keys_documented(item, &Y::Mapping(merged.clone()), &format!("{at}[]"));
                }
            }
        }
        (Y::Mapping(_), _) | (Y::Sequence(_), _) => {
            panic!("gateway.yaml {at} has a shape docs/GATEWAY.md does not give it")
        }
        _ => {}
    }
}

/// `http://NAME.NS.svc:PORT[/path]` into (NAME, PORT, path).
pub fn cluster_url(url: &str, scheme: &str) -> (String, i32, String) {
    let rest = url
        .strip_prefix(&format!("{scheme}://"))
        .unwrap_or_else(|| panic!("{url} is not {scheme}://"));
    let rest = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
    let (hostport, path) = rest.split_once('/').map_or((rest, ""), |(h, p)| (h, p));
    let (host, port) = hostport.split_once(':').unwrap();
    let svc = host
        .strip_suffix(&format!(".{NS}.svc"))
        .unwrap_or_else(|| panic!("{url} does not name a Service in {NS}"));
    (svc.to_string(), port.parse().unwrap(), format!("/{path}"))
}

/// The served model ids of the rendered engines (their `--model` flags) and their
/// adapters (`--lora-modules NAME=SOURCE`).
pub fn served_models(objs: &[Value], pods: &[Pods]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let _ = objs;
    for p in pods {
        if let Some(c) = p.spec().containers.iter().find(|c| c.name == "engine") {
            let args = args_of(c);
            out.insert(flag(&args, "--model").unwrap().to_string());
            if let Some(i) = args.iter().position(|a| a == "--lora-modules") {
                for a in args[i + 1..].iter().take_while(|a| a.contains('=')) {
                    out.insert(a.split_once('=').unwrap().0.to_string());
                }
            }
        }
    }
    out
}

/// The Strata gateway: gateway.yaml keeps to the documented schema; every served model
/// (adapters included) is a gateway model whose targets name an upstream; each upstream
/// URL names a rendered Service and port (the picker's HTTP front, whose picker serves
/// it), or the Gateway API gateway; the admin key and stores line up.
pub fn check_strata_gateway(objs: &[Value], pods: &[Pods], external_secrets: &[&str]) {
    let Some(dep) = objs
        .iter()
        .find(|o| o["kind"] == "Deployment" && name(o).ends_with("-strata-gateway"))
    else {
        return;
    };
    let gw_name = name(dep).to_string();
    let c = container(pods, &format!("Deployment/{gw_name}"), "gateway");
    let args = args_of(c);
    assert_eq!(args[0], "gateway");
    let port: i32 = flag(&args, "--port").unwrap().parse().unwrap();
    assert_eq!(flag(&args, "--host"), Some("0.0.0.0"));
    let pods_of_gw: Vec<&Pods> = pods
        .iter()
        .filter(|p| p.owner == format!("Deployment/{gw_name}"))
        .collect();
    assert_eq!(pods_of_gw[0].port_named("http"), Some(port));
    let db = flag(&args, "--db").unwrap();
    let mounts = c.volume_mounts.clone().unwrap();
    assert!(
        mounts
            .iter()
            .any(|m| db.starts_with(&format!("{}/", m.mount_path)) && m.read_only != Some(true)),
        "the SQLite file {db} is on a writable volume"
    );
    // The admin key comes from a Secret that is rendered or named as existing.
    let env = c.env.clone().unwrap();
    let admin = env.iter().find(|e| e.name == "STRATA_ADMIN_KEY").unwrap();
    let sref = admin
        .value_from
        .as_ref()
        .unwrap()
        .secret_key_ref
        .as_ref()
        .unwrap();
    if !external_secrets.contains(&sref.name.as_str()) {
        let s: Secret = typed(find(objs, "Secret", &sref.name));
        let key = s.data.unwrap()[&sref.key].0.clone();
        assert!(key.len() >= 32, "a generated admin key is long");
    }
    // gateway.yaml, from the Secret mounted at --config's folder.
    let cfg_path = flag(&args, "--config").unwrap();
    let secret_name = pods_of_gw[0]
        .spec()
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .find_map(|v| v.secret.as_ref())
        .and_then(|s| s.secret_name.clone())
        .unwrap();
    assert!(
        mounts
            .iter()
            .any(|m| cfg_path.starts_with(&m.mount_path) && m.name == "config"),
        "--config {cfg_path} is in the mounted Secret"
    );
    let secret: Secret = typed(find(objs, "Secret", &secret_name));
    let text = String::from_utf8(secret.data.unwrap()["gateway.yaml"].0.clone()).unwrap();
    let cfg: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
    keys_documented(&cfg, &documented_gateway_schema(), "");

    let services: BTreeMap<String, Service> = of_kind(objs, "Service")
        .map(|o| (name(o).to_string(), typed(o)))
        .collect();
    let mut upstreams = BTreeSet::new();
    for u in cfg["upstreams"].as_sequence().unwrap() {
        let uname = u["name"].as_str().unwrap().to_string();
        let kind = u["kind"].as_str().unwrap();
        assert!(
            ["openai", "strata_router"].contains(&kind),
            "upstream kind {kind}"
        );
        let base_url = u["base_url"].as_str().unwrap();
        let scheme = if base_url.starts_with("https://") {
            // An https upstream is verified against a CA file the gateway has mounted.
            let ca = u["ca_file"]
                .as_str()
                .expect("an https upstream names its CA");
            assert!(
                mounts
                    .iter()
                    .any(|m| ca.starts_with(&format!("{}/", m.mount_path))),
                "upstream {uname}: ca_file {ca} is not mounted"
            );
            "https"
        } else {
            "http"
        };
        let (svc, sport, path) = cluster_url(base_url, scheme);
        if let Some(s) = services.get(&svc) {
            // The picker's HTTP front: a rendered Service port that reaches pickers that
            // serve HTTP on it.
            let target = service_port(s, sport)
                .unwrap_or_else(|| panic!("upstream {uname}: Service {svc} has no port {sport}"));
            assert_eq!(path, "/");
            for p in check_service(s, pods) {
                let epp = p
                    .spec()
                    .containers
                    .iter()
                    .find(|c| c.name == "epp")
                    .unwrap();
                let http = router_args(epp).http_port.unwrap();
                assert_eq!(Some(i32::from(http)), p.port_named(&target));
                assert_ne!(http, 0, "{}: the HTTP front is on", p.owner);
            }
        } else {
            // The Gateway API gateway's Service: made by its implementation, not the
            // chart; a model's path must be one a rendered route rewrites to its pool.
            assert!(
                svc.ends_with("-gateway") || svc.contains("gateway"),
                "upstream {uname} names {svc}, neither a rendered Service nor the Gateway's"
            );
            if path != "/" {
                let routes: Vec<&Value> = of_kind(objs, "HTTPRoute").collect();
                assert!(
                    routes
                        .iter()
                        .any(
                            |r| r["spec"]["rules"].as_array().unwrap().iter().any(|rule| {
                                rule["matches"][0]["path"]["value"] == path.as_str()
                                    && rule["filters"][0]["urlRewrite"]["path"]
                                        ["replacePrefixMatch"]
                                        == "/"
                            })
                        ),
                    "no route rewrites {path}"
                );
            }
        }
        upstreams.insert(uname);
    }
    let mut names = BTreeSet::new();
    for m in cfg["models"].as_sequence().unwrap() {
        names.insert(m["name"].as_str().unwrap().to_string());
        for t in m["targets"].as_sequence().unwrap() {
            assert!(upstreams.contains(t["upstream"].as_str().unwrap()));
        }
    }
    for served in served_models(objs, pods) {
        assert!(
            names.contains(&served),
            "the gateway does not route model {served}"
        );
    }
    // Stores: in-chart ones are rendered Services with those ports, and the PostgreSQL
    // password is the one the database was given.
    for (key, scheme) in [("limits", "redis"), ("store", "postgres")] {
        let url = if key == "store" {
            cfg["store"]["url"].as_str()
        } else {
            cfg["limits"]["redis_url"].as_str()
        };
        let Some(url) = url else { continue };
        let (svc, sport, _) = match url.contains(&format!(".{NS}.svc")) {
            true => cluster_url(url, scheme),
            false => continue,
        };
        let s = &services[&svc];
        let target = service_port(s, sport).unwrap();
        for p in check_service(s, pods) {
            assert!(p.owner.starts_with("StatefulSet/"));
            assert!(p.port_named(&target).is_some());
        }
        if scheme == "postgres" {
            let password = url
                .split_once("://")
                .unwrap()
                .1
                .split_once('@')
                .unwrap()
                .0
                .split_once(':')
                .unwrap()
                .1;
            let secret: Secret = typed(find(objs, "Secret", &svc));
            assert_eq!(secret.data.unwrap()["password"].0, password.as_bytes());
        }
    }
    if cfg["store"]["backend"] != "postgres" {
        assert_eq!(
            dep["spec"]["replicas"], 1,
            "SQLite serves one gateway replica"
        );
    }
}

/// Prefill/decode: each P/D model's two Deployments carry the role label the picker's
/// profile reads, share the pool (whose selector covers both), expose the KV-transfer
/// port and pass it to the engine; the picker runs the P/D profile pair.
pub fn check_pd(objs: &[Value], pods: &[Pods]) -> usize {
    let mut pd_models = 0;
    for pool in of_kind(objs, "InferencePool") {
        let sel = json_labels(&pool["spec"]["selector"]["matchLabels"]);
        let engines = selected(pods, &sel);
        let roles: BTreeSet<String> = engines
            .iter()
            .filter_map(|p| p.labels().get(ROLE_LABEL).cloned())
            .collect();
        if roles.is_empty() {
            continue;
        }
        pd_models += 1;
        assert_eq!(
            roles,
            BTreeSet::from(["decode".to_string(), "prefill".to_string()]),
            "pool {} serves both roles",
            name(pool)
        );
        assert!(!sel.contains_key(ROLE_LABEL), "the pool selects both roles");
        for p in &engines {
            let role = p.labels()[ROLE_LABEL].clone();
            assert!(
                p.owner.ends_with(&format!("-{role}")),
                "{} is {role}",
                p.owner
            );
            let kv = p
                .port_named("kv-transfer")
                .expect("the KV-transfer port is a container port");
            let c = p
                .spec()
                .containers
                .iter()
                .find(|c| c.name == "engine")
                .unwrap();
            let args = args_of(c);
            if args[0] == "engine" {
                assert_eq!(flag(&args, "--kv-role"), Some(role.as_str()));
                if role == "prefill" {
                    assert_eq!(
                        flag(&args, "--kv-transfer-port"),
                        Some(kv.to_string().as_str())
                    );
                    assert_eq!(flag(&args, "--kv-transfer-host"), Some("$(POD_IP)"));
                } else {
                    assert!(flag(&args, "--kv-peers").is_some());
                }
            } else {
                let cfg: Value =
                    serde_json::from_str(flag(&args, "--kv-transfer-config").unwrap()).unwrap();
                assert_eq!(cfg["kv_connector"], "NixlConnector");
                let env = c.env.clone().unwrap();
                let port = env
                    .iter()
                    .find(|e| e.name == "VLLM_NIXL_SIDE_CHANNEL_PORT")
                    .unwrap();
                assert_eq!(port.value.as_deref(), Some(kv.to_string().as_str()));
            }
        }
        let epr = pool["spec"]["endpointPickerRef"]["name"].as_str().unwrap();
        let epp = container(pods, &format!("Deployment/{epr}"), "epp");
        assert!(
            router_args(epp).pd_threshold.is_some(),
            "{epr} runs the P/D profiles"
        );
        // The NetworkPolicy lets the decoders reach the prefill engines.
        let engine_name = sel["app.kubernetes.io/name"].clone();
        let np: NetworkPolicy = typed(find(objs, "NetworkPolicy", &engine_name));
        assert!(np.spec.unwrap().ingress.unwrap().iter().any(|r| {
            r.from.iter().flatten().any(|f| {
                f.pod_selector
                    .as_ref()
                    .is_some_and(|s| match_labels(s) == sel)
            })
        }));
    }
    pd_models
}

/// The controller and KEDA scale workloads that are rendered.
pub fn check_scaling(objs: &[Value]) {
    for cm in of_kind(objs, "ConfigMap").filter(|o| name(o).ends_with("-controller")) {
        let cm: ConfigMap = typed(cm);
        let cfg: serde_yaml::Value =
            serde_yaml::from_str(&cm.data.unwrap()["controller.yaml"]).unwrap();
        let kind = cfg["driver"]["targetKind"].as_str().unwrap();
        find(objs, kind, cfg["driver"]["name"].as_str().unwrap());
        assert_eq!(cfg["driver"]["namespace"], NS);
    }
    for so in of_kind(objs, "ScaledObject") {
        let t = &so["spec"]["scaleTargetRef"];
        find(
            objs,
            t["kind"].as_str().unwrap(),
            t["name"].as_str().unwrap(),
        );
        let addr = so["spec"]["triggers"][0]["metadata"]["scalerAddress"]
            .as_str()
            .unwrap();
        let (host, port) = addr.rsplit_once(':').unwrap();
        let svc: Service = typed(find(
            objs,
            "Service",
            host.strip_suffix(&format!(".{NS}.svc")).unwrap(),
        ));
        assert!(service_port(&svc, port.parse().unwrap()).is_some());
    }
}

/// Dashboards: ConfigMaps with the sidecar's label whose data is a Grafana dashboard.
pub fn check_dashboards(objs: &[Value]) -> usize {
    let mut n = 0;
    for o in of_kind(objs, "ConfigMap").filter(|o| name(o).contains("-dashboard-")) {
        assert_eq!(o["metadata"]["labels"]["grafana_dashboard"], "1");
        let cm: ConfigMap = typed(o);
        for (file, text) in cm.data.unwrap() {
            let d: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{file}: {e}"));
            assert!(d["title"].is_string() && d["uid"].is_string());
            let panels = d["panels"].as_array().unwrap();
            assert!(!panels.is_empty());
            for p in panels {
                assert!(p["targets"]
                    .as_array()
                    .is_some_and(|t| t.iter().all(|t| t["expr"].is_string())));
            }
            n += 1;
        }
    }
    n
}

/// Everything that holds for every values file.
pub fn check_render(objs: &[Value], external_secrets: &[&str]) -> Vec<Pods> {
    check_all_typed(objs);
    let pods = pod_templates(objs);
    check_pods_hardened(&pods);
    check_pools_and_routes(objs, &pods);
    check_services_monitors_pdbs(objs, &pods);
    check_network_policies(objs, &pods);
    check_strata_gateway(objs, &pods, external_secrets);
    check_pd(objs, &pods);
    check_scaling(objs);
    check_dashboards(objs);
    pods
}

/// The controllers whose `kubernetesRollout.pools` select the pods of engine workload
/// `engine` (by its `app.kubernetes.io/name`).
fn rollout_controllers_of(objs: &[Value], engine: &str) -> Vec<String> {
    let label = format!("app.kubernetes.io/name={engine}");
    of_kind(objs, "ConfigMap")
        .filter_map(|o| {
            let text = o["data"]["controller.yaml"].as_str()?;
            let cfg: serde_yaml::Value = serde_yaml::from_str(text).ok()?;
            let pools = cfg["kubernetesRollout"]["pools"].as_mapping()?;
            pools
                .values()
                .filter_map(|v| v.as_str())
                .any(|sel| sel.split(',').any(|kv| kv == label))
                .then(|| name(o).to_string())
        })
        .collect()
}
