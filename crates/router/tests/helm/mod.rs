//! Shared by the chart tests: `helm` itself, rendering, the rendered objects and their
//! pod templates, label selectors.

pub mod checks;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;

use clap::Parser;
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, PodSpec, PodTemplateSpec, Probe, Secret, Service, ServiceAccount,
};
use k8s_openapi::api::networking::v1::{NetworkPolicy, NetworkPolicyPeer};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::Deserialize as _;
use serde_json::Value;
use strata_router::RouterArgs;

pub const NS: &str = "serving";
pub const UID: i64 = 65532;
pub const ROLE_LABEL: &str = "llm-d.ai/role";

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn chart() -> PathBuf {
    repo().join("deploy/helm/strata")
}

pub fn helm() -> PathBuf {
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
    std::env::var_os("HOME")
        .map(|h| PathBuf::from(h).join(".cache/strata-tools/helm"))
        .filter(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "helm is not installed: put helm 4.x on PATH or in $HELM \
                 (scripts/install-k8s-tools.sh installs it into ~/.cache/strata-tools)"
            )
        })
}

pub fn helm_run(args: &[String]) -> std::process::Output {
    Command::new(helm())
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running helm {args:?}: {e}"))
}

/// The values files of the matrix: every `ci/*-values.yaml`.
pub fn matrix() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(chart().join("ci"))
        .expect("deploy/helm/strata/ci exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with("-values.yaml"))
        .collect();
    files.sort();
    files
}

pub fn values_file(name: &str) -> PathBuf {
    chart().join("ci").join(format!("{name}-values.yaml"))
}

pub fn template_args(files: &[PathBuf], sets: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "template",
        "t",
        chart().to_str().unwrap(),
        "--namespace",
        NS,
    ]
    .map(String::from)
    .to_vec();
    for f in files {
        args.push("-f".into());
        args.push(f.to_str().unwrap().into());
    }
    for s in sets {
        args.push("--set".into());
        args.push((*s).into());
    }
    args
}

/// `helm template` with values files and `--set` values: every rendered object, as JSON.
pub fn render(files: &[PathBuf], sets: &[&str]) -> Vec<Value> {
    let out = helm_run(&template_args(files, sets));
    assert!(
        out.status.success(),
        "helm template {files:?} {sets:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let mut objects = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        // serde_yaml refuses duplicate keys, which Kubernetes would reject too.
        let v = serde_yaml::Value::deserialize(doc).expect("a rendered document is valid YAML");
        if !v.is_null() {
            objects.push(serde_json::to_value(v).unwrap());
        }
    }
    objects
}

/// The error `helm template` gives, for values that must be refused.
pub fn render_err(files: &[PathBuf], sets: &[&str]) -> String {
    let out = helm_run(&template_args(files, sets));
    assert!(
        !out.status.success(),
        "{files:?} {sets:?} should fail to render"
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

pub fn typed<T: serde::de::DeserializeOwned>(v: &Value) -> T {
    serde_json::from_value(v.clone()).unwrap_or_else(|e| {
        panic!(
            "{} {} does not deserialize: {e}",
            v["kind"], v["metadata"]["name"]
        )
    })
}

pub fn name(o: &Value) -> &str {
    o["metadata"]["name"].as_str().unwrap()
}

pub fn of_kind<'a>(objs: &'a [Value], kind: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
    objs.iter().filter(move |o| o["kind"] == kind)
}

pub fn find<'a>(objs: &'a [Value], kind: &str, n: &str) -> &'a Value {
    objs.iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == n)
        .unwrap_or_else(|| panic!("no {kind} {n} rendered; got {:?}", kinds(objs)))
}

pub fn kinds(objs: &[Value]) -> Vec<String> {
    objs.iter()
        .map(|o| format!("{}/{}", o["kind"].as_str().unwrap_or("?"), name(o)))
        .collect()
}

pub type Labels = BTreeMap<String, String>;

/// A rendered workload's pod template, with where it came from.
pub struct Pods {
    pub owner: String,
    pub template: PodTemplateSpec,
    /// A StatefulSet's volumeClaimTemplates: volumes of its pods too.
    pub claims: BTreeSet<String>,
}

impl Pods {
    pub fn labels(&self) -> Labels {
        self.template
            .metadata
            .as_ref()
            .and_then(|m| m.labels.clone())
            .unwrap_or_default()
    }
    pub fn spec(&self) -> &PodSpec {
        self.template.spec.as_ref().unwrap()
    }
    pub fn container_ports(&self) -> Vec<(String, i32)> {
        self.spec()
            .containers
            .iter()
            .flat_map(|c| c.ports.clone().unwrap_or_default())
            .map(|p| (p.name.unwrap_or_default(), p.container_port))
            .collect()
    }
    pub fn port_named(&self, port: &str) -> Option<i32> {
        self.container_ports()
            .into_iter()
            .find(|(n, _)| n == port)
            .map(|(_, p)| p)
    }
}

/// Every pod template rendered: Deployments, StatefulSets, LeaderWorkerSet leaders and
/// workers. Checks on the way that each workload's selector selects its own pods.
pub fn pod_templates(objs: &[Value]) -> Vec<Pods> {
    let mut out = Vec::new();
    for o in objs {
        let owner = format!("{}/{}", o["kind"].as_str().unwrap(), name(o));
        let mut claims = BTreeSet::new();
        let (selector, templates): (Option<LabelSelector>, Vec<PodTemplateSpec>) =
            match o["kind"].as_str().unwrap() {
                "Deployment" => {
                    let d: Deployment = typed(o);
                    let s = d.spec.unwrap();
                    (Some(s.selector), vec![s.template])
                }
                "StatefulSet" => {
                    let d: StatefulSet = typed(o);
                    let s = d.spec.unwrap();
                    for c in s.volume_claim_templates.iter().flatten() {
                        claims.insert(c.metadata.name.clone().unwrap());
                    }
                    (Some(s.selector), vec![s.template])
                }
                "LeaderWorkerSet" => {
                    // The labels the LeaderWorkerSet controller gives its pods: the set's
                    // name, and worker index 0 for leaders (here 1 for the workers).
                    let t = &o["spec"]["leaderWorkerTemplate"];
                    let mut ts = Vec::new();
                    for (which, index) in [("leaderTemplate", "0"), ("workerTemplate", "1")] {
                        let mut pt: PodTemplateSpec = typed(&t[which]);
                        let labels = pt
                            .metadata
                            .get_or_insert_with(Default::default)
                            .labels
                            .get_or_insert_with(Default::default);
                        labels.insert("leaderworkerset.sigs.k8s.io/name".into(), name(o).into());
                        labels.insert(
                            "leaderworkerset.sigs.k8s.io/worker-index".into(),
                            index.into(),
                        );
                        ts.push(pt);
                    }
                    (None, ts)
                }
                _ => continue,
            };
        for template in templates {
            let p = Pods {
                owner: owner.clone(),
                template,
                claims: claims.clone(),
            };
            if let Some(sel) = &selector {
                assert!(
                    selects(sel, &p.labels()),
                    "{owner}: its selector does not select its own pods"
                );
            }
            out.push(p);
        }
    }
    out
}

pub fn match_labels(sel: &LabelSelector) -> Labels {
    assert!(
        sel.match_expressions.is_none(),
        "the chart selects by labels only"
    );
    sel.match_labels.clone().unwrap_or_default()
}

pub fn selects(sel: &LabelSelector, labels: &Labels) -> bool {
    subset(&match_labels(sel), labels)
}

pub fn subset(sel: &Labels, labels: &Labels) -> bool {
    !sel.is_empty() && sel.iter().all(|(k, v)| labels.get(k) == Some(v))
}

pub fn selected<'a>(pods: &'a [Pods], sel: &Labels) -> Vec<&'a Pods> {
    pods.iter().filter(|p| subset(sel, &p.labels())).collect()
}

pub fn json_labels(v: &Value) -> Labels {
    serde_json::from_value(v.clone()).expect("a label map")
}

/// The container named `name` among the pods of a workload.
pub fn container<'a>(pods: &'a [Pods], owner: &str, name: &str) -> &'a Container {
    pods.iter()
        .find(|p| p.owner == owner)
        .unwrap_or_else(|| panic!("no workload {owner}"))
        .spec()
        .containers
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("{owner}: no container {name}"))
}

pub fn args_of(c: &Container) -> Vec<String> {
    c.args.clone().unwrap_or_default()
}

pub fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == name)
        .map(|i| args[i + 1].as_str())
}

#[derive(Parser)]
pub struct RouterCli {
    #[command(flatten)]
    pub args: RouterArgs,
}

pub fn router_args(c: &Container) -> RouterArgs {
    let args = args_of(c);
    assert_eq!(args[0], "router");
    RouterCli::try_parse_from(
        std::iter::once("strata-router".to_string()).chain(args[1..].iter().cloned()),
    )
    .unwrap_or_else(|e| panic!("picker args {args:?}: {e}"))
    .args
}

pub fn service_port(svc: &Service, port: i32) -> Option<String> {
    svc.spec
        .as_ref()?
        .ports
        .as_ref()?
        .iter()
        .find(|p| p.port == port)
        .and_then(|p| match p.target_port.as_ref() {
            Some(IntOrString::String(s)) => Some(s.clone()),
            _ => None,
        })
}
