//! The whole Helm chart over the matrix of values files in `deploy/helm/strata/ci/`
//! (minimal, full, multi-model, P/D, scale to zero, external stores, TLS): `helm lint --strict`
//! passes for each; every rendered object deserializes into its `k8s-openapi` type (CRD
//! objects are checked field by field); and the objects line up: every selector selects
//! rendered pods, every named port exists where it points, each pool's picker watches that
//! pool, each route sends to a rendered pool, each NetworkPolicy peer is a rendered pod, the
//! Strata gateway's `gateway.yaml` keeps to the documented schema and its upstream URLs name
//! rendered Services and ports; every container runs as uid 65532 with a read-only root
//! filesystem, no privilege escalation and no capabilities, with readiness and liveness
//! probes and resource requests.
//!
//! Needs `helm` (4.x) on PATH, in `$HELM`, or in `~/.cache/strata-tools/` (CI installs it
//! with `scripts/install-k8s-tools.sh`); without it every test here fails saying so.

mod helm;

use std::collections::{BTreeMap, BTreeSet};

use helm::checks::*;
use helm::*;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use serde_json::Value;

#[test]
fn every_values_file_lints_and_lines_up() {
    let files = matrix();
    let names: Vec<String> = files
        .iter()
        .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    for want in [
        "minimal",
        "full",
        "multi-model",
        "pd",
        "scale-to-zero",
        "external-stores",
        "tls",
        "canary-analysis",
    ] {
        assert!(
            names.contains(&format!("{want}-values.yaml")),
            "ci/{want}-values.yaml"
        );
    }
    for f in &files {
        let out = helm_run(&[
            "lint".into(),
            chart().to_str().unwrap().into(),
            "--strict".into(),
            "-f".into(),
            f.to_str().unwrap().into(),
        ]);
        assert!(
            out.status.success(),
            "helm lint {f:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let objs = render(std::slice::from_ref(f), &[]);
        check_render(&objs, &["strata-admin"]);
    }
}

#[test]
fn leader_worker_sets_line_up_too() {
    // Multi-node models: every model of the multi-model file as LeaderWorkerSet groups
    // (pods of a group admit each other; the pools select the leaders).
    let objs = render(
        &[values_file("multi-model")],
        &["engine.workload=LeaderWorkerSet", "keda.enabled=true"],
    );
    check_render(&objs, &[]);
    let lws = find(&objs, "LeaderWorkerSet", "t-llama-engine");
    assert_eq!(lws["spec"]["leaderWorkerTemplate"]["size"], 2);
    let pool = find(&objs, "InferencePool", "t-llama-pool");
    assert_eq!(
        pool["spec"]["selector"]["matchLabels"]["leaderworkerset.sigs.k8s.io/worker-index"],
        "0"
    );
    let so = find(&objs, "ScaledObject", "t-llama-engine");
    assert_eq!(so["spec"]["scaleTargetRef"]["kind"], "LeaderWorkerSet");
}

#[test]
fn default_values_render_the_objects_they_always_did() {
    let objs = render(&[], &[]);
    let mut got = kinds(&objs);
    got.sort();
    let mut want: Vec<String> = [
        "ConfigMap/t-controller",
        "ConfigMap/t-epp",
        "Deployment/t-controller",
        "Deployment/t-engine",
        "Deployment/t-epp",
        "Gateway/t-gateway",
        "HTTPRoute/t",
        "InferencePool/t-pool",
        "Role/t-controller",
        "Role/t-epp",
        "RoleBinding/t-controller",
        "RoleBinding/t-epp",
        "Service/t-controller",
        "Service/t-epp",
        "ServiceAccount/t-controller",
        "ServiceAccount/t-epp",
    ]
    .map(String::from)
    .to_vec();
    want.sort();
    assert_eq!(got, want);
    let pods = check_render(&objs, &[]);
    // The picker serves ext_proc only (no Strata gateway to serve over HTTP).
    let epp = container(&pods, "Deployment/t-epp", "epp");
    assert_eq!(router_args(epp).http_port, Some(0));
    // An explicit empty `models` is the same render.
    assert_eq!(render(&[], &["models=null"]), objs);
    // vLLM pods get a GPU, in requests and limits, and tolerate the GPU taint.
    let engine = container(&pods, "Deployment/t-engine", "engine");
    let res = engine.resources.clone().unwrap();
    assert_eq!(res.limits.unwrap()["nvidia.com/gpu"].0, "1");
    assert_eq!(res.requests.unwrap()["nvidia.com/gpu"].0, "1");
    let spec = pods
        .iter()
        .find(|p| p.owner == "Deployment/t-engine")
        .unwrap()
        .spec();
    assert!(spec
        .tolerations
        .as_ref()
        .unwrap()
        .iter()
        .any(|t| t.key.as_deref() == Some("nvidia.com/gpu")));
}

#[test]
fn minimal_serves_through_the_pickers_http_front() {
    let objs = render(&[values_file("minimal")], &[]);
    check_render(&objs, &[]);
    assert!(!objs
        .iter()
        .any(|o| o["kind"] == "Gateway" || o["kind"] == "HTTPRoute"));
    let secret: Secret = typed(find(&objs, "Secret", "t-strata-gateway"));
    let cfg: serde_yaml::Value =
        serde_yaml::from_slice(&secret.data.unwrap()["gateway.yaml"].0).unwrap();
    assert_eq!(
        cfg["upstreams"][0]["base_url"],
        "http://t-epp.serving.svc:8080"
    );
    assert_eq!(cfg["upstreams"][0]["kind"], "strata_router");
    assert_eq!(
        cfg["models"][0]["name"],
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    );
    assert!(cfg.get("store").is_none(), "SQLite, the gateway's default");
    // Strata engines run on CPUs: no GPU asked for.
    let pods = pod_templates(&objs);
    let engine = container(&pods, "Deployment/t-engine", "engine");
    assert!(!engine
        .resources
        .clone()
        .unwrap()
        .requests
        .unwrap()
        .contains_key("nvidia.com/gpu"));
}

#[test]
fn full_renders_every_component() {
    let objs = render(&[values_file("full")], &[]);
    let pods = check_render(&objs, &[]);
    for k in [
        "StatefulSet/t-redis",
        "StatefulSet/t-postgres",
        "Deployment/t-strata-gateway",
        "ScaledObject/t-engine",
        "ServiceMonitor/t-engine",
        "ServiceMonitor/t-picker",
        "ServiceMonitor/t-controller",
        "ServiceMonitor/t-gateway",
        "PodDisruptionBudget/t-engine",
        "PodDisruptionBudget/t-strata-gateway",
        "NetworkPolicy/t-engine",
        "NetworkPolicy/t-redis",
        "NetworkPolicy/t-postgres",
        "Secret/t-strata-gateway-admin",
    ] {
        assert!(kinds(&objs).iter().any(|x| x == k), "{k} is rendered");
    }
    assert_eq!(
        check_dashboards(&objs),
        2,
        "the platform and engine dashboards"
    );
    let secret: Secret = typed(find(&objs, "Secret", "t-strata-gateway"));
    let cfg: serde_yaml::Value =
        serde_yaml::from_slice(&secret.data.unwrap()["gateway.yaml"].0).unwrap();
    assert_eq!(cfg["store"]["backend"], "postgres");
    assert_eq!(cfg["limits"]["backend"], "redis");
    assert_eq!(cfg["cache"]["backend"], "redis");
    assert_eq!(
        cfg["upstreams"][0]["base_url"],
        "http://t-gateway.serving.svc:80"
    );
    // The stores are reachable from the Strata gateway only.
    for store in ["t-redis", "t-postgres"] {
        let np: NetworkPolicy = typed(find(&objs, "NetworkPolicy", store));
        let from = &np.spec.unwrap().ingress.unwrap()[0].from.clone().unwrap()[0];
        assert_eq!(
            match_labels(from.pod_selector.as_ref().unwrap())["app.kubernetes.io/name"],
            "t-strata-gateway"
        );
    }
    // The engines' GPUs, node selector and tolerations come from the values.
    let spec = pods
        .iter()
        .find(|p| p.owner == "Deployment/t-engine")
        .unwrap()
        .spec();
    assert_eq!(
        spec.node_selector.as_ref().unwrap()["nvidia.com/gpu.product"],
        "NVIDIA-H100-80GB-HBM3"
    );
    let keys: Vec<_> = spec
        .tolerations
        .as_ref()
        .unwrap()
        .iter()
        .filter_map(|t| t.key.clone())
        .collect();
    assert!(
        keys.contains(&"dedicated".to_string()) && keys.contains(&"nvidia.com/gpu".to_string())
    );
    // The adapter is served by the engine and routed by the gateway.
    let args = args_of(container(&pods, "Deployment/t-engine", "engine"));
    assert!(args.iter().any(|a| a == "--enable-lora"));
    assert!(cfg["models"]
        .as_sequence()
        .unwrap()
        .iter()
        .any(|m| m["name"] == "sql-lora"));
}

#[test]
fn multi_model_renders_one_stack_per_model() {
    let objs = render(&[values_file("multi-model")], &[]);
    let pods = check_render(&objs, &[]);
    for m in ["llama", "qwen", "small"] {
        for k in [
            format!("Deployment/t-{m}-engine"),
            format!("InferencePool/t-{m}-pool"),
            format!("Deployment/t-{m}-epp"),
            format!("Deployment/t-{m}-controller"),
            format!("HTTPRoute/t-{m}"),
        ] {
            assert!(kinds(&objs).contains(&k), "{k} is rendered");
        }
        // Each picker watches its own pool only.
        let epp = container(&pods, &format!("Deployment/t-{m}-epp"), "epp");
        assert_eq!(
            router_args(epp).pool_name.as_deref(),
            Some(format!("t-{m}-pool").as_str())
        );
    }
    // Pools do not overlap: each selects its own model's pods only.
    let mut owners = BTreeSet::new();
    for pool in of_kind(&objs, "InferencePool") {
        let sel = json_labels(&pool["spec"]["selector"]["matchLabels"]);
        let chosen: BTreeSet<String> = selected(&pods, &sel)
            .iter()
            .map(|p| p.owner.clone())
            .collect();
        assert_eq!(chosen.len(), 1, "{}", name(pool));
        assert!(owners.is_disjoint(&chosen));
        owners.extend(chosen);
    }
    // Per-model engine settings: the second model has two GPUs, the third is a Strata mock.
    let qwen = container(&pods, "Deployment/t-qwen-engine", "engine");
    assert_eq!(
        qwen.resources.clone().unwrap().limits.unwrap()["nvidia.com/gpu"].0,
        "2"
    );
    let small = container(&pods, "Deployment/t-small-engine", "engine");
    assert_eq!(args_of(small)[0], "engine");
    assert_eq!(
        pods.iter()
            .find(|p| p.owner == "Deployment/t-small-engine")
            .unwrap()
            .labels()["inference.networking.k8s.io/engine-type"],
        "strata"
    );
    // The gateway routes each model, alias and adapter to that model's picker.
    let secret: Secret = typed(find(&objs, "Secret", "t-strata-gateway"));
    let cfg: serde_yaml::Value =
        serde_yaml::from_slice(&secret.data.unwrap()["gateway.yaml"].0).unwrap();
    let route = |model: &str| -> String {
        let m = cfg["models"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|m| m["name"] == model)
            .unwrap_or_else(|| panic!("no gateway model {model}"));
        let up = m["targets"][0]["upstream"].as_str().unwrap();
        let u = cfg["upstreams"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|u| u["name"] == up)
            .unwrap();
        u["base_url"].as_str().unwrap().to_string()
    };
    assert_eq!(
        route("meta-llama/Llama-3.1-8B-Instruct"),
        "http://t-llama-epp.serving.svc:8080"
    );
    assert_eq!(route("sql-lora"), "http://t-llama-epp.serving.svc:8080");
    assert_eq!(
        route("Qwen/Qwen2.5-7B-Instruct"),
        "http://t-qwen-epp.serving.svc:8080"
    );
    assert_eq!(
        route("HuggingFaceTB/SmolLM2-135M-Instruct"),
        "http://t-small-epp.serving.svc:8080"
    );
    let llama = cfg["models"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "meta-llama/Llama-3.1-8B-Instruct")
        .unwrap();
    assert_eq!(llama["aliases"][0], "default");
    // The canary shares llama's public name: 90 % stable, 10 % canary, by weight.
    let targets = llama["targets"].as_sequence().unwrap();
    assert_eq!(targets.len(), 2);
    assert_eq!(
        (&targets[0]["upstream"], &targets[0]["weight"]),
        (&"llama".into(), &90.into())
    );
    assert_eq!(
        (&targets[1]["upstream"], &targets[1]["weight"]),
        (&"llama-next".into(), &10.into())
    );
    assert!(
        !cfg["models"]
            .as_sequence()
            .unwrap()
            .iter()
            .any(|m| m["targets"][0]["upstream"] == "llama-next"),
        "a canary is no public model of its own"
    );
    let canary = container(&pods, "Deployment/t-llama-next-engine", "engine");
    assert_eq!(canary.image.as_deref(), Some("vllm/vllm-openai:v0.33.0"));
    // Its route has no header rule: BBR clients of that model name reach the stable pool.
    let r = find(&objs, "HTTPRoute", "t-llama-next");
    assert_eq!(r["spec"]["rules"].as_array().unwrap().len(), 1);
    // Routes for clients of the Gateway API gateway match the body's model by BBR's header.
    let r = find(&objs, "HTTPRoute", "t-qwen");
    assert_eq!(
        r["spec"]["rules"][0]["matches"][0]["headers"][0]["value"],
        "Qwen/Qwen2.5-7B-Instruct"
    );
}

#[test]
fn a_canary_with_analysis_is_moved_by_its_baselines_controller() {
    let objs = render(&[values_file("canary-analysis")], &[]);
    let pods = check_render(&objs, &[]);
    // llama's controller serves the rollout API over llama's route and both pools.
    let cm: ConfigMap = typed(find(&objs, "ConfigMap", "t-llama-controller"));
    let cfg: serde_yaml::Value =
        serde_yaml::from_str(&cm.data.unwrap()["controller.yaml"]).unwrap();
    let k = &cfg["kubernetesRollout"];
    assert_eq!(k["route"], "t-llama");
    let route = find(&objs, "HTTPRoute", "t-llama");
    let backends: Vec<&str> = route["spec"]["rules"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r["backendRefs"].as_array().unwrap())
        .map(|b| b["name"].as_str().unwrap())
        .collect();
    assert!(
        backends.iter().all(|b| *b == "t-llama-pool"),
        "{backends:?}"
    );
    let pools = k["pools"].as_mapping().unwrap();
    assert_eq!(pools.len(), 2);
    for (pool, owner) in [
        ("t-llama-pool", "Deployment/t-llama-engine"),
        ("t-llama-next-pool", "Deployment/t-llama-next-engine"),
    ] {
        // Each selector string selects exactly that pool's pods, as the pool does.
        let sel: Labels = pools[pool]
            .as_str()
            .unwrap()
            .split(',')
            .map(|kv| {
                let (k, v) = kv.split_once('=').unwrap();
                (k.to_string(), v.to_string())
            })
            .collect();
        let chosen: Vec<&str> = selected(&pods, &sel)
            .iter()
            .map(|p| p.owner.as_str())
            .collect();
        assert_eq!(chosen, vec![owner], "{pool}");
        let ip = find(&objs, "InferencePool", pool);
        assert_eq!(json_labels(&ip["spec"]["selector"]["matchLabels"]), sel);
    }
    // The canary's controller has no rollout of its own.
    let cm: ConfigMap = typed(find(&objs, "ConfigMap", "t-llama-next-controller"));
    let cfg: serde_yaml::Value =
        serde_yaml::from_str(&cm.data.unwrap()["controller.yaml"]).unwrap();
    assert!(cfg.get("kubernetesRollout").is_none());
    // It may patch that one route, and nothing else new.
    let role = find(&objs, "Role", "t-llama-controller");
    let rule = role["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["resources"][0] == "httproutes")
        .expect("an httproutes rule");
    assert_eq!(rule["resourceNames"], serde_json::json!(["t-llama"]));
    assert_eq!(rule["verbs"], serde_json::json!(["get", "patch"]));
    let other = find(&objs, "Role", "t-llama-next-controller");
    assert!(!other.to_string().contains("httproutes"));
    // The gateway gives the canary no share: the route's weights do.
    let secret: Secret = typed(find(&objs, "Secret", "t-strata-gateway"));
    let gw: serde_yaml::Value =
        serde_yaml::from_slice(&secret.data.unwrap()["gateway.yaml"].0).unwrap();
    let llama = gw["models"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "meta-llama/Llama-3.1-8B-Instruct")
        .unwrap();
    let targets = llama["targets"].as_sequence().unwrap();
    assert_eq!(targets.len(), 1);
    assert_eq!(targets[0]["upstream"], "llama");
    // llama's controller may read the canary's /metrics through its NetworkPolicy.
    let np = find(&objs, "NetworkPolicy", "t-llama-next-engine");
    assert!(
        np["spec"]["ingress"]
            .to_string()
            .contains("t-llama-controller"),
        "{}",
        np["spec"]["ingress"]
    );
}

#[test]
fn prefill_decode_wires_roles_and_kv_ports() {
    let objs = render(&[values_file("pd")], &[]);
    let pods = check_render(&objs, &[]);
    assert_eq!(check_pd(&objs, &pods), 2, "both models are disaggregated");
    let decode = find(&objs, "Deployment", "t-llama-engine-decode");
    assert_eq!(decode["spec"]["replicas"], 3);
    assert_eq!(
        find(&objs, "Deployment", "t-llama-engine-prefill")["spec"]["replicas"],
        2
    );
    let epp = container(&pods, "Deployment/t-llama-epp", "epp");
    assert_eq!(router_args(epp).pd_threshold, Some(512));
    let mock = container(&pods, "Deployment/t-mock-engine-prefill", "engine");
    assert_eq!(flag(&args_of(mock), "--kv-transfer-port"), Some("7100"));
    // The controller and KEDA scale the decoders.
    let so = find(&objs, "ScaledObject", "t-llama-engine");
    assert_eq!(
        so["spec"]["scaleTargetRef"]["name"],
        "t-llama-engine-decode"
    );
    // Both roles have their own disruption budget.
    find(&objs, "PodDisruptionBudget", "t-llama-engine-prefill");
    find(&objs, "PodDisruptionBudget", "t-llama-engine-decode");
}

#[test]
fn scale_to_zero_lets_keda_reach_zero() {
    let objs = render(&[values_file("scale-to-zero")], &[]);
    check_render(&objs, &[]);
    let so = find(&objs, "ScaledObject", "t-engine");
    assert_eq!(so["spec"]["minReplicaCount"], 0);
    assert_eq!(find(&objs, "Deployment", "t-engine")["spec"]["replicas"], 0);
    let cm: ConfigMap = typed(find(&objs, "ConfigMap", "t-controller"));
    let cfg: serde_yaml::Value =
        serde_yaml::from_str(&cm.data.unwrap()["controller.yaml"]).unwrap();
    assert_eq!(cfg["autoscale"]["minReplicas"], 0);
}

#[test]
fn external_stores_are_used_by_url() {
    let objs = render(&[values_file("external-stores")], &[]);
    check_render(&objs, &["strata-admin"]);
    assert!(
        !objs.iter().any(|o| o["kind"] == "StatefulSet"),
        "no in-chart store"
    );
    assert!(!kinds(&objs)
        .iter()
        .any(|k| k == "Secret/t-strata-gateway-admin"));
    let secret: Secret = typed(find(&objs, "Secret", "t-strata-gateway"));
    let cfg: serde_yaml::Value =
        serde_yaml::from_slice(&secret.data.unwrap()["gateway.yaml"].0).unwrap();
    assert_eq!(
        cfg["store"]["url"],
        "postgres://strata:secret@pg.example.internal:5432/strata"
    );
    assert_eq!(
        cfg["limits"]["redis_url"],
        "redis://redis.example.internal:6379/0"
    );
    assert_eq!(
        cfg["cache"]["redis_url"],
        "redis://redis.example.internal:6379/0"
    );
    assert_eq!(
        cfg["upstreams"][0]["base_url"],
        "http://shared-gateway-istio.serving.svc:8080"
    );
    let gw: Deployment = typed(find(&objs, "Deployment", "t-strata-gateway"));
    assert_eq!(gw.spec.as_ref().unwrap().replicas, Some(3));
    let c = &gw.spec.unwrap().template.spec.unwrap().containers[0];
    let r = c
        .env
        .as_ref()
        .unwrap()
        .iter()
        .find(|e| e.name == "STRATA_ADMIN_KEY")
        .unwrap();
    let k = r
        .value_from
        .as_ref()
        .unwrap()
        .secret_key_ref
        .as_ref()
        .unwrap();
    assert_eq!((k.name.as_str(), k.key.as_str()), ("strata-admin", "token"));
    let route = find(&objs, "HTTPRoute", "t");
    assert_eq!(route["spec"]["parentRefs"][0]["name"], "shared-gateway");
}

#[test]
fn generated_secrets_are_generated_once_per_render() {
    // The PostgreSQL password in gateway.yaml is the one its StatefulSet gets, even though
    // both are generated in different templates (check_strata_gateway compares them), and
    // two renders do not share a password.
    let a = render(&[values_file("full")], &[]);
    let b = render(&[values_file("full")], &[]);
    let pw = |objs: &[Value]| {
        typed::<Secret>(find(objs, "Secret", "t-postgres"))
            .data
            .unwrap()["password"]
            .0
            .clone()
    };
    assert_eq!(pw(&a).len(), 32);
    assert_ne!(pw(&a), pw(&b));
}

#[test]
fn contradictory_values_are_refused() {
    for (sets, says) in [
        (
            vec![
                "models[0].name=a",
                "models[0].model=m",
                "models[0].canary.of=b",
                "models[0].canary.weight=5",
            ],
            "names no model entry",
        ),
        (
            vec![
                "models[0].name=a",
                "models[0].model=m",
                "models[1].name=b",
                "models[1].model=m",
                "models[1].canary.of=a",
                "models[1].canary.weight=101",
            ],
            "0 to 100",
        ),
        (
            vec![
                "models[0].name=a",
                "models[0].model=m",
                "models[1].name=b",
                "models[1].model=m",
                "models[1].canary.of=a",
                "models[1].canary.analysis=true",
                "models[1].canary.weight=10",
            ],
            "leave weight out",
        ),
        (
            vec![
                "models[0].name=a",
                "models[0].model=m",
                "models[1].name=b",
                "models[1].model=m",
                "models[1].canary.of=a",
                "models[1].canary.analysis=true",
                "strataGateway.enabled=true",
                "strataGateway.upstream=router",
            ],
            "needs strataGateway.upstream gatewayApi",
        ),
        (
            vec![
                "models[0].name=a",
                "models[0].model=m",
                "models[1].name=b",
                "models[1].model=m",
                "models[1].canary.of=a",
                "models[1].canary.analysis=true",
                "httpRoute.enabled=false",
            ],
            "needs httpRoute.enabled",
        ),
        (
            vec![
                "models[0].name=a",
                "models[0].model=m",
                "models[1].name=a",
                "models[1].model=n",
            ],
            "used twice",
        ),
        (
            vec!["models[0].name=Bad_Name", "models[0].model=m"],
            "DNS label",
        ),
        (vec!["models[0].name=a"], "models[0].model"),
        (vec!["models[0].model=m"], "models[0].name"),
        (
            vec!["engine.pd.enabled=true", "engine.kind=sglang"],
            "engine.pd needs engine.kind",
        ),
        (
            vec!["engine.pd.enabled=true", "engine.workload=LeaderWorkerSet"],
            "engine.pd needs engine.workload",
        ),
        (
            vec!["redis.enabled=true", "redis.url=redis://x:6379/"],
            "not both",
        ),
        (
            vec!["postgres.enabled=true", "postgres.url=postgres://x/y"],
            "not both",
        ),
        (
            vec!["strataGateway.enabled=true", "strataGateway.replicas=2"],
            "shared store",
        ),
        (
            vec!["strataGateway.enabled=true", "picker.enabled=false"],
            "needs picker.enabled",
        ),
        (
            vec![
                "strataGateway.enabled=true",
                "strataGateway.upstream=direct",
            ],
            "strataGateway.upstream must be",
        ),
        (
            vec![
                "models[0].name=a-model-name-long-enough-to-overflow-a-dns-label-name",
                "models[0].model=m",
            ],
            "longer than 63",
        ),
    ] {
        let err = render_err(&[], &sets);
        assert!(err.contains(says), "{sets:?}: {err}");
    }
}

/// The TLS files a container reads (flag values, controller.yaml and gateway.yaml paths)
/// all lie under its read-only `tls` mount, which is the pod's `tls` volume.
fn tls_paths_are_mounted(p: &Pods, c: &k8s_openapi::api::core::v1::Container, paths: &[&str]) {
    let mount = c
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .find(|m| m.name == "tls")
        .unwrap_or_else(|| panic!("{} {}: no tls mount", p.owner, c.name));
    assert_eq!(mount.read_only, Some(true), "{}", p.owner);
    for path in paths {
        assert!(
            path.starts_with(&format!("{}/", mount.mount_path)),
            "{} {}: {path} is not under {}",
            p.owner,
            c.name,
            mount.mount_path
        );
    }
}

/// The pod's `tls` volume: a Secret's name, or the CSI driver's attributes.
fn tls_volume(p: &Pods) -> &k8s_openapi::api::core::v1::Volume {
    p.spec()
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .find(|v| v.name == "tls")
        .unwrap_or_else(|| panic!("{}: no tls volume", p.owner))
}

fn probes_are_https(p: &Pods, c: &k8s_openapi::api::core::v1::Container) {
    for probe in [&c.readiness_probe, &c.liveness_probe, &c.startup_probe]
        .into_iter()
        .flatten()
    {
        let get = probe.http_get.as_ref().unwrap();
        assert_eq!(
            get.scheme.as_deref(),
            Some("HTTPS"),
            "{} {}",
            p.owner,
            c.name
        );
    }
}

#[test]
fn tls_mounts_certificates_and_every_client_trusts_the_ca() {
    let objs = render(&[values_file("tls")], &[]);
    let pods = check_render(&objs, &[]);
    let certs: BTreeMap<String, &Value> = of_kind(&objs, "Certificate")
        .map(|c| (c["spec"]["secretName"].as_str().unwrap().to_string(), c))
        .collect();
    let mut mounted = BTreeSet::new();
    for p in &pods {
        let c = &p.spec().containers[0];
        let args = args_of(c);
        let vol = tls_volume(p);
        match c.name.as_str() {
            "engine" => {
                // One certificate per pod, naming its IP, from cert-manager's CSI driver.
                let csi = vol.csi.as_ref().expect("the CSI driver");
                assert_eq!(csi.driver, "csi.cert-manager.io");
                let attrs = csi.volume_attributes.as_ref().unwrap();
                assert_eq!(attrs["csi.cert-manager.io/ip-sans"], "${POD_IP}");
                assert_eq!(attrs["csi.cert-manager.io/issuer-name"], "strata-ca");
                assert_eq!(attrs["csi.cert-manager.io/issuer-kind"], "ClusterIssuer");
                probes_are_https(p, c);
                let strata = args[0] == "engine";
                let (cert, key) = if strata {
                    ("--tls-cert", "--tls-key")
                } else {
                    ("--ssl-certfile", "--ssl-keyfile")
                };
                let mut files = vec![flag(&args, cert).unwrap(), flag(&args, key).unwrap()];
                let role = p.labels().get("llm-d.ai/role").cloned();
                if strata && role.is_some() {
                    assert!(args.iter().any(|a| a == "--kv-tls"), "{}", p.owner);
                    files.push(flag(&args, "--kv-tls-ca").unwrap());
                }
                tls_paths_are_mounted(p, c, &files);
            }
            "epp" => {
                let r = router_args(c);
                assert!(r.pool_https, "{}: the pool's pods are https", p.owner);
                let files = [
                    r.http.tls_cert.clone().expect("ext_proc over TLS"),
                    r.http.tls_key.clone().unwrap(),
                    r.upstream_tls_ca.clone().expect("the CA of the pods"),
                ];
                let files: Vec<&str> = files.iter().map(|f| f.to_str().unwrap()).collect();
                tls_paths_are_mounted(p, c, &files);
                mounted.insert(vol.secret.as_ref().unwrap().secret_name.clone().unwrap());
            }
            "controller" => {
                probes_are_https(p, c);
                let owner = p.owner.trim_start_matches("Deployment/");
                let cm: ConfigMap = typed(find(&objs, "ConfigMap", owner));
                let cfg: serde_yaml::Value =
                    serde_yaml::from_str(&cm.data.unwrap()["controller.yaml"]).unwrap();
                assert_eq!(cfg["driver"]["https"], true);
                let files: Vec<&str> = ["caFile", "certFile", "keyFile"]
                    .iter()
                    .map(|k| cfg["tls"][*k].as_str().unwrap())
                    .collect();
                tls_paths_are_mounted(p, c, &files);
                mounted.insert(vol.secret.as_ref().unwrap().secret_name.clone().unwrap());
            }
            "gateway" => {
                probes_are_https(p, c);
                let secret: Secret = typed(find(&objs, "Secret", "t-strata-gateway"));
                let cfg: serde_yaml::Value =
                    serde_yaml::from_slice(&secret.data.unwrap()["gateway.yaml"].0).unwrap();
                let mut files = vec![
                    cfg["server"]["tls"]["cert"].as_str().unwrap(),
                    cfg["server"]["tls"]["key"].as_str().unwrap(),
                ];
                for u in cfg["upstreams"].as_sequence().unwrap() {
                    assert!(u["base_url"].as_str().unwrap().starts_with("https://"));
                    files.push(u["ca_file"].as_str().unwrap());
                }
                tls_paths_are_mounted(p, c, &files);
                mounted.insert(vol.secret.as_ref().unwrap().secret_name.clone().unwrap());
            }
            other => panic!("unexpected container {other}"),
        }
    }
    // Each Secret mounted is a Certificate's, and each Certificate is mounted by the pods
    // of the object it names, whose Service its names carry.
    assert_eq!(mounted, certs.keys().cloned().collect::<BTreeSet<_>>());
    for (secret, cert) in &certs {
        let object = secret.strip_suffix("-tls").unwrap();
        assert_eq!(name(cert), object);
        let dns: Vec<&str> = cert["spec"]["dnsNames"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_str().unwrap())
            .collect();
        assert!(
            dns.contains(&format!("{object}.{NS}.svc").as_str()),
            "{dns:?}"
        );
        find(&objs, "Service", object);
    }
    assert_eq!(certs.len(), 5, "two pickers, two controllers, the gateway");
    // ServiceMonitors scrape the HTTPS ports with a CA a Certificate's Secret carries.
    for (component, server_name) in [
        ("engine", None),
        ("controller", Some("t-controller.serving.svc")),
        ("gateway", Some("t-strata-gateway.serving.svc")),
    ] {
        let sm = find(&objs, "ServiceMonitor", &format!("t-{component}"));
        let ep = &sm["spec"]["endpoints"][0];
        assert_eq!(ep["scheme"], "https", "{component}");
        let ca = ep["tlsConfig"]["ca"]["secret"]["name"].as_str().unwrap();
        assert!(certs.contains_key(ca), "{component}: {ca}");
        assert_eq!(ep["tlsConfig"]["serverName"].as_str(), server_name);
        if let Some(n) = server_name {
            let object = ca.strip_suffix("-tls").unwrap();
            let c = find(&objs, "Certificate", object);
            assert!(c["spec"]["dnsNames"]
                .as_array()
                .unwrap()
                .iter()
                .any(|d| d == n));
        }
    }
    let picker = find(&objs, "ServiceMonitor", "t-picker");
    assert!(picker["spec"]["endpoints"][0].get("scheme").is_none());
}

#[test]
fn tls_with_existing_secrets_mounts_them_and_makes_no_certificate() {
    let objs = render(
        &[values_file("tls")],
        &[
            "tls.certManager.enabled=false",
            "tls.picker.existingSecret=picker-tls",
            "tls.controller.existingSecret=controller-tls",
            "tls.strataGateway.existingSecret=gateway-tls",
            "tls.engine.existingSecret=engine-tls",
        ],
    );
    let pods = check_render(&objs, &[]);
    assert_eq!(of_kind(&objs, "Certificate").count(), 0);
    for p in &pods {
        let want = match p.spec().containers[0].name.as_str() {
            "engine" => "engine-tls",
            "epp" => "picker-tls",
            "controller" => "controller-tls",
            "gateway" => "gateway-tls",
            other => panic!("{other}"),
        };
        let secret = tls_volume(p).secret.as_ref().expect("a Secret volume");
        assert_eq!(secret.secret_name.as_deref(), Some(want), "{}", p.owner);
    }
    // Mutual TLS on the pickers: with the Gateway API path only.
    let objs = render(
        &[values_file("tls")],
        &[
            "tls.picker.clientAuth=true",
            "strataGateway.upstream=gatewayApi",
        ],
    );
    let pods = check_render(&objs, &[]);
    let epp = container(&pods, "Deployment/t-llama-epp", "epp");
    assert!(router_args(epp).http.tls_client_ca.is_some());
}

#[test]
fn tls_values_that_cannot_work_are_refused() {
    for (sets, says) in [
        (vec!["tls.certManager.enabled=false"], "tls.enabled needs"),
        (
            vec![
                "tls.certManager.enabled=false",
                "tls.picker.existingSecret=p",
                "tls.controller.existingSecret=c",
                "tls.strataGateway.existingSecret=g",
            ],
            "tls.engine.existingSecret",
        ),
        (vec!["tls.certManager.issuerRef.name="], "issuerRef.name"),
        (vec!["tls.picker.clientAuth=true"], "clientAuth"),
        (
            vec!["models[0].engine.kind=sglang"],
            "engine.kind strata or vllm",
        ),
    ] {
        let err = render_err(&[values_file("tls")], &sets);
        assert!(err.contains(says), "{sets:?}: {err}");
    }
}
