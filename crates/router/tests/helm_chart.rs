//! The Helm chart in `deploy/helm/strata`: `helm lint` passes, and what `helm template`
//! renders deserializes into the `k8s-openapi` types (the CRD objects are checked field by
//! field), with names and ports that line up: the picker's flags name the rendered pool and
//! parse as `strata router` flags, the pool selects the engine pods on their port and
//! points at the picker's Service, the route attaches to the gateway and the pool, KEDA's
//! trigger is the controller's scaler.
//!
//! Needs `helm` (4.x) on PATH, in `$HELM`, or in `~/.cache/strata-tools/` (CI installs it
//! with `scripts/install-k8s-tools.sh`); without it every test here fails saying so.

use std::path::PathBuf;
use std::process::Command;

use clap::Parser;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Container, PodTemplateSpec, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use serde_json::Value;
use strata_router::RouterArgs;

const NS: &str = "serving";

fn chart() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../deploy/helm/strata")
}

fn helm() -> PathBuf {
    if let Some(p) = std::env::var_os("HELM") {
        return PathBuf::from(p);
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("helm"))
            .find(|p| p.is_file())
    });
    if let Some(p) = on_path {
        return p;
    }
    let cached = std::env::var_os("HOME")
        .map(|h| PathBuf::from(h).join(".cache/strata-tools/helm"))
        .filter(|p| p.is_file());
    cached.unwrap_or_else(|| {
        panic!(
            "helm is not installed: put helm 4.x on PATH or in $HELM \
             (scripts/install-k8s-tools.sh installs it into ~/.cache/strata-tools)"
        )
    })
}

fn helm_run(args: &[&str]) -> std::process::Output {
    Command::new(helm())
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running helm {args:?}: {e}"))
}

/// `helm template` with `--set` values: every rendered object, as JSON.
fn render(sets: &[&str]) -> Vec<Value> {
    let chart = chart();
    let mut args = vec!["template", "t", chart.to_str().unwrap(), "--namespace", NS];
    for s in sets {
        args.push("--set");
        args.push(s);
    }
    let out = helm_run(&args);
    assert!(
        out.status.success(),
        "helm template {sets:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let mut objects = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        // serde_yaml refuses duplicate keys, which Kubernetes would reject too.
        let v = serde_yaml::Value::deserialize(doc).expect("a rendered document is valid YAML");
        if v.is_null() {
            continue;
        }
        objects.push(serde_json::to_value(v).unwrap());
    }
    objects
}

use serde::Deserialize as _;

fn find<'a>(objs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objs.iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} rendered; got {:?}", kinds(objs)))
}

fn kinds(objs: &[Value]) -> Vec<String> {
    objs.iter()
        .map(|o| {
            format!(
                "{}/{}",
                o["kind"].as_str().unwrap_or("?"),
                o["metadata"]["name"].as_str().unwrap_or("?")
            )
        })
        .collect()
}

fn typed<T: serde::de::DeserializeOwned>(v: &Value) -> T {
    serde_json::from_value(v.clone()).unwrap_or_else(|e| {
        panic!(
            "{} {} does not deserialize: {e}",
            v["kind"], v["metadata"]["name"]
        )
    })
}

/// Every object parses as its type; the CRDs have their required fields.
fn check_all_typed(objs: &[Value]) {
    for o in objs {
        assert_eq!(o["metadata"]["namespace"], NS, "{}", o["metadata"]["name"]);
        match o["kind"].as_str().unwrap() {
            "Deployment" => drop(typed::<Deployment>(o)),
            "Service" => drop(typed::<Service>(o)),
            "ServiceAccount" => drop(typed::<ServiceAccount>(o)),
            "ConfigMap" => drop(typed::<ConfigMap>(o)),
            "Role" => drop(typed::<Role>(o)),
            "RoleBinding" => drop(typed::<RoleBinding>(o)),
            "InferencePool" => {
                assert_eq!(o["apiVersion"], "inference.networking.k8s.io/v1");
                assert!(o["spec"]["selector"]["matchLabels"].is_object());
                let ports = o["spec"]["targetPorts"].as_array().unwrap();
                assert!((1..=8).contains(&ports.len()));
            }
            "HTTPRoute" | "Gateway" => {
                assert_eq!(o["apiVersion"], "gateway.networking.k8s.io/v1")
            }
            "ScaledObject" => assert_eq!(o["apiVersion"], "keda.sh/v1alpha1"),
            "LeaderWorkerSet" => {
                assert_eq!(o["apiVersion"], "leaderworkerset.x-k8s.io/v1");
                let t = &o["spec"]["leaderWorkerTemplate"];
                let _: PodTemplateSpec =
                    serde_json::from_value(t["leaderTemplate"].clone()).unwrap();
                let _: PodTemplateSpec =
                    serde_json::from_value(t["workerTemplate"].clone()).unwrap();
            }
            other => panic!("unexpected kind {other} rendered"),
        }
    }
}

fn container<'a>(d: &'a Deployment, name: &str) -> &'a Container {
    d.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|s| s.containers.iter().find(|c| c.name == name))
        .unwrap_or_else(|| panic!("no container {name}"))
}

fn flag<'a>(args: &'a [String], name: &str) -> &'a str {
    let i = args
        .iter()
        .position(|a| a == name)
        .unwrap_or_else(|| panic!("no {name} in {args:?}"));
    &args[i + 1]
}

#[derive(Parser)]
struct RouterCli {
    #[command(flatten)]
    args: RouterArgs,
}

#[test]
fn chart_lints() {
    let chart = chart();
    let c = chart.to_str().unwrap();
    for sets in [
        vec![],
        vec!["engine.workload=LeaderWorkerSet", "keda.enabled=true"],
    ] {
        let mut args = vec!["lint", c, "--strict"];
        for s in &sets {
            args.push("--set");
            args.push(s);
        }
        let out = helm_run(&args);
        assert!(
            out.status.success(),
            "helm lint {sets:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn default_render_lines_up() {
    let objs = render(&[]);
    check_all_typed(&objs);
    let pool = find(&objs, "InferencePool", "t-pool");
    let engine: Deployment = typed(find(&objs, "Deployment", "t-engine"));
    let picker: Deployment = typed(find(&objs, "Deployment", "t-epp"));
    let picker_svc: Service = typed(find(&objs, "Service", "t-epp"));

    // The pool selects the engine pods, on the port they serve.
    let pod_labels = engine
        .spec
        .as_ref()
        .unwrap()
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .clone()
        .unwrap();
    for (k, v) in pool["spec"]["selector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(
            pod_labels.get(k).map(String::as_str),
            v.as_str(),
            "pool selector {k}"
        );
    }
    assert_eq!(
        pod_labels
            .get("inference.networking.k8s.io/engine-type")
            .map(String::as_str),
        Some("vllm")
    );
    let engine_c = container(&engine, "engine");
    let engine_port = engine_c.ports.as_ref().unwrap()[0].container_port;
    assert_eq!(pool["spec"]["targetPorts"][0]["number"], engine_port);
    assert_eq!(
        flag(engine_c.args.as_ref().unwrap(), "--port"),
        engine_port.to_string()
    );

    // The picker's flags name the rendered pool and parse as `strata router` flags.
    let epp = container(&picker, "epp");
    let args = epp.args.clone().unwrap();
    assert_eq!(args[0], "router");
    let parsed = RouterCli::try_parse_from(
        std::iter::once("strata-router".to_string()).chain(args[1..].iter().cloned()),
    )
    .unwrap_or_else(|e| panic!("picker args {args:?}: {e}"))
    .args;
    assert_eq!(
        parsed.pool_name.as_deref(),
        pool["metadata"]["name"].as_str()
    );
    assert_eq!(parsed.pool_namespace, NS);
    assert_eq!(parsed.http_port, Some(0));
    let ext_proc_port = i32::from(parsed.ext_proc_port.unwrap());
    assert_eq!(parsed.health_port, 9003);
    // No fallbacks by default: the gateway's ORIGINAL_DST cluster reads one address.
    assert_eq!(parsed.ext_proc_fallbacks, 0);
    assert!(!args.iter().any(|a| a == "--ext-proc-fallbacks"));

    // The pool's picker reference is the picker's Service, on the ext_proc port, which
    // reaches the container port the picker listens on.
    let epr = &pool["spec"]["endpointPickerRef"];
    assert_eq!(epr["name"], "t-epp");
    assert_eq!(epr["kind"], "Service");
    assert_eq!(epr["port"]["number"], ext_proc_port);
    let svc_port = picker_svc
        .spec
        .as_ref()
        .unwrap()
        .ports
        .as_ref()
        .unwrap()
        .iter()
        .find(|p| p.port == ext_proc_port)
        .expect("the Service exposes the ext_proc port");
    let target = match svc_port.target_port.as_ref().unwrap() {
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(s) => s.clone(),
        other => panic!("named target port expected, got {other:?}"),
    };
    let cport = epp
        .ports
        .as_ref()
        .unwrap()
        .iter()
        .find(|p| p.name.as_deref() == Some(&target))
        .unwrap();
    assert_eq!(cport.container_port, ext_proc_port);
    // Probes use the gRPC health port and services the picker serves.
    let ready = epp.readiness_probe.as_ref().unwrap().grpc.as_ref().unwrap();
    assert_eq!(ready.port, i32::from(parsed.health_port));
    assert_eq!(ready.service.as_deref(), Some("readiness"));
    let live = epp.liveness_probe.as_ref().unwrap().grpc.as_ref().unwrap();
    assert_eq!(live.service.as_deref(), Some("liveness"));
    // The picker's service account may watch pods and read pools.
    let role: Role = typed(find(&objs, "Role", "t-epp"));
    let rules = role.rules.unwrap();
    for (group, res) in [
        ("inference.networking.k8s.io", "inferencepools"),
        ("", "pods"),
    ] {
        let r = rules
            .iter()
            .find(|r| {
                r.api_groups.as_deref() == Some(&[group.to_string()])
                    && r.resources.as_deref() == Some(&[res.to_string()])
            })
            .unwrap_or_else(|| panic!("no rule for {res}"));
        assert!(
            r.verbs.iter().any(|v| v == "watch"),
            "{res} must be watchable"
        );
    }
    let binding: RoleBinding = typed(find(&objs, "RoleBinding", "t-epp"));
    assert_eq!(binding.subjects.unwrap()[0].name, "t-epp");
    assert_eq!(
        picker
            .spec
            .unwrap()
            .template
            .spec
            .unwrap()
            .service_account_name
            .as_deref(),
        Some("t-epp")
    );

    // The route attaches to the gateway and sends to the pool.
    let route = find(&objs, "HTTPRoute", "t");
    assert_eq!(route["spec"]["parentRefs"][0]["name"], "t-gateway");
    find(&objs, "Gateway", "t-gateway");
    let backend = &route["spec"]["rules"][0]["backendRefs"][0];
    assert_eq!(backend["kind"], "InferencePool");
    assert_eq!(backend["group"], "inference.networking.k8s.io");
    assert_eq!(backend["name"], pool["metadata"]["name"]);

    // The controller scales the engine workload; its config is valid YAML with the keys
    // the Kubernetes driver reads.
    let cm: ConfigMap = typed(find(&objs, "ConfigMap", "t-controller"));
    let cfg: serde_yaml::Value =
        serde_yaml::from_str(&cm.data.unwrap()["controller.yaml"]).unwrap();
    assert_eq!(cfg["driver"]["kind"], "kubernetes");
    assert_eq!(cfg["driver"]["name"], "t-engine");
    assert_eq!(cfg["driver"]["namespace"], NS);
    assert_eq!(cfg["driver"]["port"].as_i64(), Some(i64::from(engine_port)));
    // No ScaledObject unless asked for.
    assert!(!objs.iter().any(|o| o["kind"] == "ScaledObject"));
}

#[test]
fn leader_worker_set_with_keda() {
    let objs = render(&[
        "engine.workload=LeaderWorkerSet",
        "keda.enabled=true",
        "engine.kvEvents.enabled=true",
        "pool.name=llama",
    ]);
    check_all_typed(&objs);
    assert!(!objs
        .iter()
        .any(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == "t-engine"));
    let lws = find(&objs, "LeaderWorkerSet", "t-engine");
    let pool = find(&objs, "InferencePool", "llama");
    // Only group leaders serve: the pool selects worker index 0.
    let sel = pool["spec"]["selector"]["matchLabels"].as_object().unwrap();
    assert_eq!(sel["leaderworkerset.sigs.k8s.io/worker-index"], "0");
    let leader = &lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"];
    assert_eq!(
        leader["metadata"]["annotations"]["strata.dev/kv-events"], "5557",
        "KV events are announced to the picker"
    );
    let picker: Deployment = typed(find(&objs, "Deployment", "t-epp"));
    let args = container(&picker, "epp").args.clone().unwrap();
    assert_eq!(flag(&args, "--pool-name"), "llama");
    // KEDA scales the LeaderWorkerSet with the controller's external scaler.
    let so = find(&objs, "ScaledObject", "t-engine");
    assert_eq!(so["spec"]["scaleTargetRef"]["kind"], "LeaderWorkerSet");
    assert_eq!(so["spec"]["scaleTargetRef"]["name"], "t-engine");
    let ctl: Service = typed(find(&objs, "Service", "t-controller"));
    let keda_port = ctl
        .spec
        .unwrap()
        .ports
        .unwrap()
        .into_iter()
        .find(|p| p.name.as_deref() == Some("grpc-keda"))
        .unwrap()
        .port;
    assert_eq!(so["spec"]["triggers"][0]["type"], "external");
    assert_eq!(
        so["spec"]["triggers"][0]["metadata"]["scalerAddress"],
        format!("t-controller.{NS}.svc:{keda_port}")
    );
    let cm: ConfigMap = typed(find(&objs, "ConfigMap", "t-controller"));
    let cfg: serde_yaml::Value =
        serde_yaml::from_str(&cm.data.unwrap()["controller.yaml"]).unwrap();
    assert_eq!(cfg["driver"]["targetKind"], "LeaderWorkerSet");
    assert_eq!(
        cfg["kedaListen"].as_str(),
        Some(format!("0.0.0.0:{keda_port}").as_str())
    );
}

#[test]
fn each_component_switches_off() {
    let all = kinds(&render(&[]));
    for (switch, gone) in [
        ("engine.enabled=false", "Deployment/t-engine"),
        ("pool.enabled=false", "InferencePool/t-pool"),
        ("picker.enabled=false", "Deployment/t-epp"),
        ("gateway.enabled=false", "Gateway/t-gateway"),
        ("httpRoute.enabled=false", "HTTPRoute/t"),
        ("controller.enabled=false", "Deployment/t-controller"),
    ] {
        assert!(all.iter().any(|k| k == gone), "{gone} is on by default");
        let mut sets = vec![switch];
        if switch == "gateway.enabled=false" {
            sets.push("gateway.existingName=shared");
        }
        let objs = render(&sets);
        check_all_typed(&objs);
        let now = kinds(&objs);
        assert!(
            !now.iter().any(|k| k == gone),
            "{switch} still renders {gone}"
        );
        if switch == "gateway.enabled=false" {
            let route = find(&objs, "HTTPRoute", "t");
            assert_eq!(route["spec"]["parentRefs"][0]["name"], "shared");
        }
        if switch == "picker.enabled=false" {
            let pool = find(&objs, "InferencePool", "t-pool");
            assert!(pool["spec"].get("endpointPickerRef").is_none());
        }
    }
}

#[test]
fn bad_values_are_refused() {
    let chart = chart();
    let c = chart.to_str().unwrap();
    for sets in [
        vec!["keda.enabled=true", "controller.enabled=false"],
        vec!["engine.workload=StatefulSet"],
        vec!["gateway.enabled=false"],
        vec!["picker.fallbacks=8"],
    ] {
        let mut args = vec!["template", "t", c];
        for s in &sets {
            args.push("--set");
            args.push(s);
        }
        let out = helm_run(&args);
        assert!(!out.status.success(), "{sets:?} should fail to render");
    }
}

#[test]
fn strata_engines_run_the_strata_image() {
    let objs = render(&["engine.kind=strata", "engine.strataArgs={--mock}"]);
    check_all_typed(&objs);
    let engine: Deployment = typed(find(&objs, "Deployment", "t-engine"));
    let c = container(&engine, "engine");
    assert_eq!(c.image.as_deref(), Some("strata:0.1.0"));
    let args = c.args.clone().unwrap();
    assert_eq!(args[0], "engine");
    assert!(args.iter().any(|a| a == "--mock"));
    let picker: Deployment = typed(find(&objs, "Deployment", "t-epp"));
    let pargs = container(&picker, "epp").args.clone().unwrap();
    assert_eq!(flag(&pargs, "--engine-kind"), "strata");
}

#[test]
fn picker_fallbacks_reach_its_flags() {
    let objs = render(&["picker.fallbacks=3"]);
    let picker: Deployment = typed(find(&objs, "Deployment", "t-epp"));
    let args = container(&picker, "epp").args.clone().unwrap();
    let parsed = RouterCli::try_parse_from(
        std::iter::once("strata-router".to_string()).chain(args[1..].iter().cloned()),
    )
    .unwrap_or_else(|e| panic!("picker args {args:?}: {e}"))
    .args;
    assert_eq!(parsed.ext_proc_fallbacks, 3);
    // The flag refuses what no data plane could use.
    for bad in ["8", "-1", "x"] {
        assert!(
            RouterCli::try_parse_from(["strata-router", "--ext-proc-fallbacks", bad]).is_err(),
            "--ext-proc-fallbacks {bad}"
        );
    }
}
