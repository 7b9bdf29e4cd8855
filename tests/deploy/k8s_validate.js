#!/usr/bin/env node
// Renders the shared root (deploy/k8s/root), every overlay under deploy/k8s/overlays and every
// example under deploy/k8s/examples with `kubectl kustomize` (offline) and checks each object
// against the Kubernetes OpenAPI schemas shipped in the npm package kubernetes-models (and
// @kubernetes-models/prometheus-operator for ServiceMonitor/PodMonitor), rejecting unknown
// fields as well as wrong types. Kubeflow's PyTorchJob and JobSet have no npm models: their own
// fields are checked against the structure below (written from their CRDs: kubeflow.org/v1,
// jobset.x-k8s.io/v1alpha2), their pod and Job templates against kubernetes-models. Then it
// checks what hsbn needs of the objects: the sidecar and the trainer share a memory-backed
// emptyDir holding the socket that HSBN_ADDRESS names, aggregator flags are in
// deploy/aggregator-flags.txt, every $(VAR) resolves, every sidecar --upstream names a Service
// that selects a root (in the render or in the shared root's), the root has its own
// kustomization (never a job's), a PodDisruptionBudget, a PriorityClass, anti-affinity to
// trainers and probes, and every sidecar has a liveness probe.
//
//   node k8s_validate.js DEPLOY_K8S_DIR              validate; exit 1 on any error
//   node k8s_validate.js --self-test DEPLOY_K8S_DIR  break copies on purpose; each must fail
"use strict";

const fs = require("fs");
const os = require("os");
const path = require("path");
const { execFileSync } = require("child_process");
const YAML = require("yaml");

const SCHEMA_DIR = path.join(path.dirname(require.resolve("kubernetes-models/v1/Pod")), "..", "_schemas");
const PROM_DIR = path.join(path.dirname(require.resolve("@kubernetes-models/prometheus-operator/package.json")), "_schemas");
const PROM = "ComGithubPrometheusOperatorPrometheusOperatorPkgApisMonitoringV1";
const SCHEMAS = {
  "apps/v1/Deployment": "IoK8sApiAppsV1Deployment",
  "batch/v1/Job": "IoK8sApiBatchV1Job",
  "v1/Service": "IoK8sApiCoreV1Service",
  "v1/ConfigMap": "IoK8sApiCoreV1ConfigMap",
  "v1/ServiceAccount": "IoK8sApiCoreV1ServiceAccount",
  "networking.k8s.io/v1/NetworkPolicy": "IoK8sApiNetworkingV1NetworkPolicy",
  "policy/v1/PodDisruptionBudget": "IoK8sApiPolicyV1PodDisruptionBudget",
  "scheduling.k8s.io/v1/PriorityClass": "IoK8sApiSchedulingV1PriorityClass",
  "monitoring.coreos.com/v1/ServiceMonitor": path.join(PROM_DIR, `${PROM}ServiceMonitor`),
  "monitoring.coreos.com/v1/PodMonitor": path.join(PROM_DIR, `${PROM}PodMonitor`),
};

// The fields of the two custom resources, as their CRDs define them; `k8s` hands a subtree to
// a kubernetes-models schema, `open` accepts any object there (fields hsbn's examples never set).
const str = { type: "string" }, int = { type: "integer" }, bool = { type: "boolean" }, open = { type: "object", open: true };
const META = { type: "object", props: { name: str, namespace: str, labels: open, annotations: open } };
const CRDS = {
  "kubeflow.org/v1/PyTorchJob": { type: "object", required: ["spec"], props: { metadata: META, spec: {
    type: "object", required: ["pytorchReplicaSpecs"], props: {
      nprocPerNode: str,
      elasticPolicy: open,
      runPolicy: { type: "object", props: { activeDeadlineSeconds: int, backoffLimit: int, cleanPodPolicy: { type: "string", enum: ["None", "Running", "All"] },
        managedBy: str, schedulingPolicy: open, suspend: bool, ttlSecondsAfterFinished: int } },
      pytorchReplicaSpecs: { type: "object", keys: ["Master", "Worker"], values: { type: "object", props: {
        replicas: int, restartPolicy: { type: "string", enum: ["Always", "OnFailure", "Never", "ExitCode"] },
        template: { k8s: "IoK8sApiCoreV1PodTemplateSpec" } } } } } } } },
  "jobset.x-k8s.io/v1alpha2/JobSet": { type: "object", required: ["spec"], props: { metadata: META, spec: {
    type: "object", props: {
      network: { type: "object", props: { enableDNSHostnames: bool, publishNotReadyAddresses: bool, subdomain: str } },
      failurePolicy: { type: "object", props: { maxRestarts: int, restartStrategy: { type: "string", enum: ["Recreate", "BlockingRecreate", "InPlaceRestart"] }, rules: { type: "array", items: open } } },
      successPolicy: { type: "object", required: ["operator"], props: { operator: { type: "string", enum: ["All", "Any"] }, targetReplicatedJobs: { type: "array", items: str } } },
      startupPolicy: { type: "object", required: ["startupPolicyOrder"], props: { startupPolicyOrder: { type: "string", enum: ["AnyOrder", "InOrder"] } } },
      suspend: bool, ttlSecondsAfterFinished: int, managedBy: str, coordinator: open, volumeClaimPolicies: { type: "array", items: open },
      replicatedJobs: { type: "array", items: { type: "object", required: ["name", "template"], props: {
        name: str, replicas: int, groupName: str, dependsOn: { type: "array", items: open },
        template: { k8s: "IoK8sApiBatchV1JobTemplateSpec" } } } } } } } },
};

function loadFlagContract(k8sDir) {
  const file = path.join(k8sDir, "..", "aggregator-flags.txt");
  const flags = new Set();
  for (const line of fs.readFileSync(file, "utf8").split("\n")) {
    const t = line.replace(/#.*/, "").trim();
    if (t) flags.add(t.split(/\s+/)[0]);
  }
  return flags;
}

function render(overlayDir) {
  const out = execFileSync("kubectl", ["kustomize", overlayDir], { encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] });
  return YAML.parseAllDocuments(out).map((d) => {
    if (d.errors.length) throw new Error(`${overlayDir}: YAML: ${d.errors[0].message}`);
    return d.toJS();
  }).filter((o) => o);
}

// Schema check with unknown-field detection: the compiled validators read every property the
// schema knows, so a property of the object that the validator never read is not in the schema.
function modelErrors(schema, obj, where, top) {
  const { validate } = require(schema.includes(path.sep) ? `${schema}.js` : path.join(SCHEMA_DIR, `${schema}.js`));
  const seen = new Set();
  const track = (o, p) => (o === null || typeof o !== "object") ? o : new Proxy(o, {
    get(t, k, r) {
      if (typeof k !== "string") return Reflect.get(t, k, r);
      seen.add(`${p}/${k}`);
      return track(t[k], `${p}/${k}`);
    },
  });
  const errors = [];
  if (!validate(track(obj, ""))) {
    for (const e of validate.errors) errors.push(`${where}: schema: ${e.instancePath || "/"} ${e.message || `${e.keyword} ${JSON.stringify(e.params)}`}`);
    return errors;
  }
  const walk = (o, p) => {
    if (o === null || typeof o !== "object") return;
    for (const k of Object.keys(o)) {
      if (top && p === "" && (k === "apiVersion" || k === "kind")) continue;
      if (!seen.has(`${p}/${k}`)) errors.push(`${where}: schema: unknown field ${p}/${k}`);
      else walk(o[k], `${p}/${k}`);
    }
  };
  walk(obj, "");
  return errors;
}

function crdErrors(obj, shape, where) {
  const errors = [];
  const typeOf = (v) => Array.isArray(v) ? "array" : v === null ? "null" : Number.isInteger(v) ? "integer" : typeof v;
  const walk = (v, sch, p) => {
    if (sch.k8s) { errors.push(...modelErrors(sch.k8s, v, `${where}: ${p}`, false)); return; }
    const t = typeOf(v);
    if (t !== sch.type) { errors.push(`${where}: schema: ${p || "/"} must be ${sch.type}, not ${t}`); return; }
    if (sch.enum && !sch.enum.includes(v)) errors.push(`${where}: schema: ${p} must be one of ${sch.enum.join(", ")}`);
    if (t === "array") v.forEach((x, i) => walk(x, sch.items, `${p}/${i}`));
    if (t !== "object") return;
    for (const r of sch.required || []) if (!(r in v)) errors.push(`${where}: schema: ${p || "/"} misses required ${r}`);
    if (sch.open) return;
    for (const [k, x] of Object.entries(v)) {
      if (p === "" && (k === "apiVersion" || k === "kind")) continue;
      if (sch.keys && !sch.keys.includes(k)) { errors.push(`${where}: schema: unknown field ${p}/${k}`); continue; }
      const sub = sch.props ? sch.props[k] : sch.values;
      if (!sub) errors.push(`${where}: schema: unknown field ${p}/${k}`);
      else walk(x, sub, `${p}/${k}`);
    }
  };
  walk(obj, shape, "");
  return errors;
}

function schemaErrors(obj) {
  const key = `${obj.apiVersion}/${obj.kind}`;
  const where = `${obj.kind}/${obj.metadata && obj.metadata.name}`;
  if (CRDS[key]) return crdErrors(obj, CRDS[key], where);
  const name = SCHEMAS[key];
  if (!name) return [`${where}: no schema known for ${key}; add it to SCHEMAS`];
  return modelErrors(name, obj, where, true);
}

// The pod templates of an object, and how many pods (nodes) a trainer object runs.
function podTemplates(obj) {
  if (obj.kind === "Deployment" || obj.kind === "Job") return [obj.spec.template];
  if (obj.kind === "PyTorchJob") return Object.values(obj.spec.pytorchReplicaSpecs || {}).map((r) => r.template);
  if (obj.kind === "JobSet") return (obj.spec.replicatedJobs || []).map((r) => r.template.spec.template);
  return [];
}
const TRAINER_KINDS = ["Job", "PyTorchJob", "JobSet"];
function nodesOf(obj) {
  if (obj.kind === "Job") return obj.spec.completions || 1;
  if (obj.kind === "PyTorchJob") return Object.values(obj.spec.pytorchReplicaSpecs).reduce((n, r) => n + (r.replicas || 1), 0);
  if (obj.kind === "JobSet") return obj.spec.replicatedJobs.reduce((n, r) => n + (r.replicas || 1) * (r.template.spec.completions || 1), 0);
  return 1;
}
const matches = (sel, labels) => Object.entries(sel || {}).every(([k, v]) => (labels || {})[k] === v);

function flagsOf(container) {
  const flags = {};
  for (const a of container.args || []) {
    const m = /^(--[a-z0-9-]+)(?:=(.*))?$/.exec(a);
    if (m) flags[m[1]] = m[2] === undefined ? "" : m[2];
  }
  return flags;
}

const isAggregator = (c) => (c.args || []).some((a) => a.startsWith("--role="));
const envValue = (c, name) => { const e = (c.env || []).find((x) => x.name === name); return e && e.value; };

function resolveEnv(c, s) {
  return s.replace(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g, (m, v) => (envValue(c, v) !== undefined ? envValue(c, v) : m));
}

function hsbnErrors(objs, contract, shared, isRoot) {
  const errors = [];
  const services = objs.filter((o) => o.kind === "Service");
  const templates = objs.flatMap((o) => podTemplates(o).map((t) => [o, t]));
  // Sidecars may point at the shared root's Service, deployed by its own kustomization.
  const upstreamServices = services.concat(shared.filter((o) => o.kind === "Service"));
  const upstreamTemplates = templates.concat(shared.flatMap((o) => podTemplates(o).map((t) => [o, t])));
  for (const [obj, tpl] of templates) {
    const where = `${obj.kind}/${obj.metadata.name}`;
    const spec = tpl.spec;
    const all = [...(spec.initContainers || []), ...spec.containers];
    if (!(spec.securityContext && spec.securityContext.runAsNonRoot === true)) errors.push(`${where}: pod must set securityContext.runAsNonRoot: true`);
    for (const c of all) {
      const cw = `${where}: container ${c.name}`;
      if (!(c.securityContext && c.securityContext.allowPrivilegeEscalation === false)) errors.push(`${cw}: must set allowPrivilegeEscalation: false`);
      const names = new Set((c.env || []).map((e) => e.name));
      const refs = [...(c.command || []), ...(c.args || []), ...(c.env || []).map((e) => e.value || "")];
      for (const s of refs) for (const m of s.matchAll(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g)) {
        if (!names.has(m[1])) errors.push(`${cw}: undefined variable $(${m[1]}) in "${s}"`);
      }
      if (!isAggregator(c)) continue;
      const flags = flagsOf(c);
      for (const a of c.args) if (!/^--[a-z0-9-]+=/.test(a)) errors.push(`${cw}: aggregator argument "${a}" is not --flag=value`);
      for (const f of Object.keys(flags)) if (!contract.has(f)) errors.push(`${cw}: ${f} is not in the aggregator's flag contract (deploy/aggregator-flags.txt)`);
      if (!["node", "root"].includes(flags["--role"])) errors.push(`${cw}: --role must be node or root`);
      if (!flags["--listen"]) errors.push(`${cw}: --listen is missing`);
      if (!(c.securityContext && c.securityContext.readOnlyRootFilesystem === true)) errors.push(`${cw}: aggregator must run with readOnlyRootFilesystem: true`);
      if (flags["--role"] === "root") {
        if (!isRoot) errors.push(`${cw}: a root in a job's manifests; the shared root belongs in deploy/k8s/root, so that deleting a job never deletes it`);
        for (const probe of ["startupProbe", "readinessProbe", "livenessProbe"]) if (!c[probe]) errors.push(`${cw}: the root needs a ${probe}`);
        const pc = objs.find((o) => o.kind === "PriorityClass" && o.metadata.name === spec.priorityClassName);
        if (!pc) errors.push(`${where}: the root needs a priorityClassName naming a PriorityClass of its kustomization (has ${JSON.stringify(spec.priorityClassName)})`);
        if (!objs.some((o) => o.kind === "PodDisruptionBudget" && matches(o.spec.selector.matchLabels, tpl.metadata.labels))) errors.push(`${where}: no PodDisruptionBudget selects the root`);
        const anti = (((spec.affinity || {}).podAntiAffinity || {}).preferredDuringSchedulingIgnoredDuringExecution || []).map((w) => w.podAffinityTerm)
          .concat(((spec.affinity || {}).podAntiAffinity || {}).requiredDuringSchedulingIgnoredDuringExecution || []);
        if (!anti.some((t) => t.topologyKey === "kubernetes.io/hostname" && (t.labelSelector.matchLabels || {})["app.kubernetes.io/component"] === "trainer")) errors.push(`${where}: the root needs pod anti-affinity to trainer pods (app.kubernetes.io/component: trainer, per host)`);
      }
      if (flags["--upstream"] !== undefined) {
        const [host, port] = flags["--upstream"].split(":");
        const svc = upstreamServices.find((s) => s.metadata.name === host);
        if (!svc) { errors.push(`${cw}: --upstream=${flags["--upstream"]}: no Service named ${host} in this render or the shared root's`); continue; }
        if (!svc.spec.ports.some((p) => String(p.port) === port)) errors.push(`${cw}: Service ${host} has no port ${port}`);
        const roots = upstreamTemplates.filter(([, t]) => matches(svc.spec.selector, t.metadata.labels)
          && t.spec.containers.some((x) => flagsOf(x)["--role"] === "root"));
        if (!roots.length) errors.push(`${cw}: Service ${host} selects no pod running --role=root`);
      }
    }
    if (!TRAINER_KINDS.includes(obj.kind)) continue;
    // A trainer pod: a native sidecar and a trainer sharing the socket directory in memory.
    const sidecar = (spec.initContainers || []).find((c) => flagsOf(c)["--role"] === "node");
    if (!sidecar) { errors.push(`${where}: no sidecar (init container running --role=node)`); continue; }
    if (sidecar.restartPolicy !== "Always") errors.push(`${where}: sidecar ${sidecar.name} must be a native sidecar (restartPolicy: Always)`);
    if (!sidecar.livenessProbe) errors.push(`${where}: sidecar ${sidecar.name} has no livenessProbe`);
    if ((tpl.metadata.labels || {})["app.kubernetes.io/component"] !== "trainer") errors.push(`${where}: trainer pods must carry app.kubernetes.io/component: trainer (the root's NetworkPolicy and anti-affinity select it)`);
    const listen = flagsOf(sidecar)["--listen"] || "";
    if (!listen.startsWith("unix:")) { errors.push(`${where}: sidecar must listen on a unix: socket, not "${listen}"`); continue; }
    const sockDir = path.posix.dirname(listen.slice(5));
    const mount = (sidecar.volumeMounts || []).find((m) => m.mountPath === sockDir);
    const vol = mount && (spec.volumes || []).find((v) => v.name === mount.name);
    if (!vol) errors.push(`${where}: sidecar socket directory ${sockDir} is not a mounted volume`);
    else if (!(vol.emptyDir && vol.emptyDir.medium === "Memory")) errors.push(`${where}: volume ${vol.name} holding the socket must be an emptyDir with medium: Memory`);
    const nodes = nodesOf(obj);
    if (nodes > 1 && flagsOf(sidecar)["--upstream"] === undefined) errors.push(`${where}: a multi-node job needs --upstream on its sidecar`);
    for (const c of spec.containers) {
      if (!(c.volumeMounts || []).some((m) => mount && m.name === mount.name && m.mountPath === sockDir)) errors.push(`${where}: container ${c.name} does not mount the socket volume at ${sockDir}`);
      if (envValue(c, "HSBN_ADDRESS") !== listen) errors.push(`${where}: container ${c.name}: HSBN_ADDRESS=${envValue(c, "HSBN_ADDRESS")} but the sidecar listens on ${listen}`);
      if (!(c.env || []).some((e) => e.name === "HSBN_JOB_ID")) errors.push(`${where}: container ${c.name}: HSBN_JOB_ID is not set`);
      const nn = (c.args || []).map((a) => resolveEnv(c, a)).find((a) => a.startsWith("--nnodes="));
      if (nn && Number(nn.split("=")[1]) !== nodes) errors.push(`${where}: container ${c.name}: torchrun ${nn} but the job runs ${nodes} pod(s)`);
    }
    if (obj.kind === "PyTorchJob" && !spec.containers.some((c) => c.name === "pytorch")) errors.push(`${where}: the PyTorchJob's trainer container must be named pytorch (the operator sets its variables there)`);
  }
  for (const svc of services) {
    const sel = svc.spec.selector || {};
    const podLabels = (t) => ({ ...(t.metadata.labels || {}), "batch.kubernetes.io/job-name": undefined });
    const match = templates.some(([o, t]) => Object.entries(sel).every(([k, v]) =>
      (k === "batch.kubernetes.io/job-name" && o.kind === "Job") ? o.metadata.name === v : podLabels(t)[k] === v));
    if (!match) errors.push(`Service/${svc.metadata.name}: selector ${JSON.stringify(sel)} matches no pod template`);
  }
  return errors;
}

// What is rendered: the shared root, the overlays (root-* ones are roots too), the examples.
function targets(k8sDir) {
  const list = (d) => fs.existsSync(path.join(k8sDir, d)) ? fs.readdirSync(path.join(k8sDir, d)).sort().map((x) => `${d}/${x}`) : [];
  return ["root", ...list("overlays"), ...list("examples")];
}
const isRootTarget = (t) => t === "root" || /^overlays\/root/.test(t);

function validateTree(k8sDir, only) {
  const contract = loadFlagContract(k8sDir);
  const shared = render(path.join(k8sDir, "root"));
  const report = [];
  for (const t of only || targets(k8sDir)) {
    let objs;
    try { objs = render(path.join(k8sDir, t)); } catch (e) { report.push({ target: t, errors: [`kustomize failed: ${(e.stderr || e.message).toString().split("\n")[0]}`], count: 0 }); continue; }
    const errors = objs.flatMap(schemaErrors).concat(hsbnErrors(objs, contract, isRootTarget(t) ? [] : shared, isRootTarget(t)));
    report.push({ target: t, errors, count: objs.length, kinds: objs.map((x) => `${x.kind}/${x.metadata.name}`) });
  }
  return report;
}

// Deliberately broken copies, each must be rejected with the message named here. A few are
// broken in the source and rendered again with kustomize; the rest break one field of the
// rendered objects (rendering is the slow part).
const SOURCE_MUTATIONS = [
  ["overlays/multi-node", "base/trainer-job.yaml", "imagePullPolicy: IfNotPresent", "imagePullPolice: IfNotPresent", "unknown field /spec/template/spec/initContainers/0/imagePullPolice"],
  ["root", "root/root.yaml", "containerPort: 7070", "containerPort: grpc-port", '/ports/0/containerPort type {"type":"integer"}'],
  ["overlays/multi-node", "overlays/multi-node/kustomization.yaml", "  - train-headless-service.yaml", "  - train-headless-svc.yaml", "kustomize failed"],
  ["examples/pytorchjob", "examples/pytorchjob/pytorchjob.yaml", "  nprocPerNode: \"8\"", "  nprocPerNode: 8", "/nprocPerNode must be string, not integer"],
];
const find = (objs, kind, name) => objs.find((o) => o.kind === kind && o.metadata.name === name);
const job = (b) => find(b.job, "Job", "hsbn-train").spec.template.spec;
const sidecar = (b) => job(b).initContainers[0];
const trainer = (b) => job(b).containers[0];
const root = (b) => find(b.root, "Deployment", "hsbn-root").spec.template;
const ptj = (b) => find(b.pytorchjob, "PyTorchJob", "hsbn-train").spec;
const jset = (b) => find(b.jobset, "JobSet", "hsbn-train").spec;
const OBJECT_MUTATIONS = [
  ["volumeMount without mountPath", (b) => { sidecar(b).volumeMounts[0] = { name: "hsbn-run" }; }, '"missingProperty":"mountPath"'],
  ["socket volume on disk", (b) => { delete job(b).volumes.find((v) => v.name === "hsbn-run").emptyDir.medium; }, "medium: Memory"],
  ["upstream to a missing Service", (b) => { sidecar(b).args = sidecar(b).args.map((a) => a.replace("hsbn-root:", "hsbn-rooot:")); }, "no Service named hsbn-rooot"],
  ["HSBN_ADDRESS elsewhere", (b) => { trainer(b).env.find((e) => e.name === "HSBN_ADDRESS").value = "unix:/run/hsbn/other.sock"; }, "HSBN_ADDRESS=unix:/run/hsbn/other.sock"],
  ["flag not in the contract", (b) => { root(b).spec.containers[0].args.push("--round-timeout=30000"); }, "not in the aggregator's flag contract"],
  ["undefined $(VAR)", (b) => { trainer(b).args = trainer(b).args.map((a) => a.replace("$(NODE_RANK)", "$(NODE_RANKK)")); }, "undefined variable $(NODE_RANKK)"],
  ["nnodes != pods", (b) => { const j = find(b.job, "Job", "hsbn-train"); j.spec.completions = j.spec.parallelism = 3; }, "--nnodes=2 but the job runs 3"],
  ["sidecar not native", (b) => { delete sidecar(b).restartPolicy; }, "native sidecar"],
  ["sidecar without liveness probe", (b) => { delete sidecar(b).livenessProbe; }, "has no livenessProbe"],
  ["root Service selects nothing", (b) => { root(b).metadata.labels["app.kubernetes.io/component"] = "rooot"; }, "selects no pod running --role=root"],
  ["root as root user", (b) => { delete root(b).spec.securityContext.runAsNonRoot; }, "runAsNonRoot"],
  ["root without a PodDisruptionBudget", (b) => { b.root = b.root.filter((o) => o.kind !== "PodDisruptionBudget"); }, "no PodDisruptionBudget selects the root"],
  ["root without a PriorityClass", (b) => { b.root = b.root.filter((o) => o.kind !== "PriorityClass"); }, "needs a priorityClassName"],
  ["root next to trainers", (b) => { delete root(b).spec.affinity; }, "anti-affinity to trainer pods"],
  ["root without readiness probe", (b) => { delete root(b).spec.containers[0].readinessProbe; }, "the root needs a readinessProbe"],
  ["root inside a job's manifests", (b) => { b.job.push(JSON.parse(JSON.stringify(find(b.root, "Deployment", "hsbn-root")))); }, "a root in a job's manifests"],
  ["no HSBN_JOB_ID", (b) => { trainer(b).env = trainer(b).env.filter((e) => e.name !== "HSBN_JOB_ID"); }, "HSBN_JOB_ID is not set"],
  ["single pod needs no upstream; two do", (b) => { sidecar(b).args = sidecar(b).args.filter((a) => !a.startsWith("--upstream=")); }, "needs --upstream"],
  ["PyTorchJob replica spec typo", (b) => { ptj(b).pytorchReplicaSpecs.Worker.replica = 1; }, "unknown field /spec/pytorchReplicaSpecs/Worker/replica"],
  ["PyTorchJob unknown replica type", (b) => { ptj(b).pytorchReplicaSpecs.Chief = ptj(b).pytorchReplicaSpecs.Worker; }, "unknown field /spec/pytorchReplicaSpecs/Chief"],
  ["PyTorchJob pod template typo", (b) => { ptj(b).pytorchReplicaSpecs.Master.template.spec.containers[0].imagePullPolice = "Always"; }, "unknown field /spec/containers/0/imagePullPolice"],
  ["PyTorchJob trainer not named pytorch", (b) => { ptj(b).pytorchReplicaSpecs.Worker.template.spec.containers[0].name = "trainer"; }, "must be named pytorch"],
  ["PyTorchJob sidecar without upstream", (b) => { const c = ptj(b).pytorchReplicaSpecs.Worker.template.spec.initContainers[0]; c.args = c.args.filter((a) => !a.startsWith("--upstream")); }, "needs --upstream"],
  ["JobSet network typo", (b) => { jset(b).network.enableDNSHostname = true; }, "unknown field /spec/network/enableDNSHostname"],
  ["JobSet Job template wrong type", (b) => { jset(b).replicatedJobs[0].template.spec.completions = "2"; }, '/spec/completions type {"type":"integer"}'],
  ["JobSet pods without the trainer label", (b) => { delete jset(b).replicatedJobs[0].template.spec.template.metadata.labels["app.kubernetes.io/component"]; }, "must carry app.kubernetes.io/component: trainer"],
  ["JobSet nnodes != pods", (b) => { jset(b).replicatedJobs[0].replicas = 2; }, "--nnodes=2 but the job runs 4"],
  ["ServiceMonitor typo", (b) => { find(b.rootSecure, "ServiceMonitor", "hsbn-root").spec.endpoints[0].prot = "metrics"; }, "unknown field /spec/endpoints/0/prot"],
];

function bundleErrors(b, contract) {
  const errs = (objs, shared, isRoot) => objs.flatMap(schemaErrors).concat(hsbnErrors(objs, contract, shared, isRoot));
  return [...errs(b.root, [], true), ...errs(b.rootSecure, [], true), ...errs(b.job, b.root, false),
    ...errs(b.pytorchjob, b.root, false), ...errs(b.jobset, b.root, false)];
}

function selfTest(k8sDir) {
  let failed = 0;
  const check = (label, errors, expect) => {
    const hit = errors.find((e) => e.includes(expect));
    if (hit) console.log(`ok: ${label} rejected: ${hit}`);
    else { console.log(`FAIL: ${label} was not rejected with "${expect}"; got: ${JSON.stringify(errors)}`); failed++; }
  };
  const contract = loadFlagContract(k8sDir);
  const clean = { root: render(path.join(k8sDir, "root")), rootSecure: render(path.join(k8sDir, "overlays", "root-secure")),
    job: render(path.join(k8sDir, "overlays", "multi-node")), pytorchjob: render(path.join(k8sDir, "examples", "pytorchjob")),
    jobset: render(path.join(k8sDir, "examples", "jobset")) };
  const cleanErrors = bundleErrors(clean, contract);
  if (cleanErrors.length) { console.log(`FAIL: the unmodified manifests do not validate:\n  ${cleanErrors.join("\n  ")}`); return 1; }
  for (const [label, mutate, expect] of OBJECT_MUTATIONS) {
    const b = JSON.parse(JSON.stringify(clean));
    mutate(b);
    check(label, bundleErrors(b, contract), expect);
  }
  for (const [target, file, from, to, expect] of SOURCE_MUTATIONS) {
    const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "hsbn-k8s-"));
    const copy = path.join(tmp, "k8s");
    fs.cpSync(k8sDir, copy, { recursive: true });
    fs.copyFileSync(path.join(k8sDir, "..", "aggregator-flags.txt"), path.join(tmp, "aggregator-flags.txt"));
    const f = path.join(copy, file);
    const text = fs.readFileSync(f, "utf8");
    if (!text.includes(from)) { console.log(`FAIL: ${file} no longer contains ${JSON.stringify(from)}; update SOURCE_MUTATIONS`); failed++; continue; }
    fs.writeFileSync(f, text.replace(from, to));
    const errors = validateTree(copy, [target]).flatMap((r) => r.errors);
    fs.rmSync(tmp, { recursive: true, force: true });
    check(`${file}: ${JSON.stringify(to.trim())}`, errors, expect);
  }
  const total = OBJECT_MUTATIONS.length + SOURCE_MUTATIONS.length;
  console.log(`${total - failed} passed, ${failed} failed`);
  return failed ? 1 : 0;
}

function main() {
  const args = process.argv.slice(2);
  const self = args[0] === "--self-test";
  const dir = path.resolve(self ? args[1] : args[0]);
  if (self) process.exit(selfTest(dir));
  let bad = 0;
  for (const r of validateTree(dir)) {
    console.log(`${r.errors.length ? "FAIL" : "ok"}: ${r.target}: ${r.count} objects${r.kinds ? " (" + r.kinds.join(", ") + ")" : ""}`);
    for (const e of r.errors) console.log(`  ${e}`);
    bad += r.errors.length ? 1 : 0;
  }
  process.exit(bad ? 1 : 0);
}

main();
