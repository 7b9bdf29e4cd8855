#!/usr/bin/env node
// Renders the shared root (deploy/k8s/root), the group tier (deploy/k8s/group), every overlay
// under deploy/k8s/overlays and every example under deploy/k8s/examples with `kubectl
// kustomize` (offline) and checks each object against the Kubernetes OpenAPI schemas shipped
// in the npm package kubernetes-models (and @kubernetes-models/prometheus-operator for
// ServiceMonitor/PodMonitor), rejecting unknown fields as well as wrong types. Kubeflow's PyTorchJob and JobSet have no npm models: their own
// fields are checked against the structure below (written from their CRDs: kubeflow.org/v1,
// jobset.x-k8s.io/v1alpha2), their pod and Job templates against kubernetes-models. Then it
// checks what hsbn needs of the objects: the sidecar and the trainer share a memory-backed
// emptyDir holding the socket that HSBN_ADDRESS names, aggregator flags are in
// deploy/aggregator-flags.txt for the container's role, every $(VAR) resolves, every sidecar
// --upstream names a Service that selects a root or a group aggregator (in the render or in the
// shared root's or group tier's), the root and the group aggregators have their own
// kustomizations (never a job's), a PodDisruptionBudget, a PriorityClass, anti-affinity to
// trainers and probes, every sidecar has a liveness probe. The group tier (deploy/k8s/group):
// each group aggregator is pinned to its rack and names the root; a job whose sidecars name
// group aggregators goes through them all, sets HSBN_GROUP_NODES (K, a divisor of its nodes)
// on every trainer, gives each group of K consecutive node ranks one aggregator of its own, and
// places the group's nodes in that aggregator's rack.
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

// flag -> the roles it may be given with (deploy/aggregator-flags.txt: flag, status, roles).
function loadFlagContract(k8sDir) {
  const file = path.join(k8sDir, "..", "aggregator-flags.txt");
  const flags = new Map();
  for (const line of fs.readFileSync(file, "utf8").split("\n")) {
    const t = line.replace(/#.*/, "").trim();
    if (!t) continue;
    const [flag, , roles] = t.split(/\s+/);
    flags.set(flag, new Set((roles || "").split(",")));
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
const roleOf = (tpl) => { const c = tpl.spec.containers.find(isAggregator); return c && flagsOf(c)["--role"]; };
const ROLE_NAME = { root: "root", group: "group aggregator" };

// Where a pod template is pinned: its first required nodeAffinity term's "In" expression.
function placement(tpl) {
  const terms = ((((tpl.spec.affinity || {}).nodeAffinity || {}).requiredDuringSchedulingIgnoredDuringExecution || {}).nodeSelectorTerms) || [];
  const e = terms.length === 1 && (terms[0].matchExpressions || []).find((x) => x.operator === "In" && (x.values || []).length);
  return e ? `${e.key} In [${[...e.values].sort().join(", ")}]` : null;
}

function resolveEnv(c, s) {
  return s.replace(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g, (m, v) => (envValue(c, v) !== undefined ? envValue(c, v) : m));
}

// One training job: the trainer objects whose trainers take HSBN_JOB_ID from the same literal,
// Secret key or ConfigMap key (a tier job is a Job per group), else each object alone (a
// fieldRef, such as the Job's uid, differs between objects).
function trainingJobKey(obj) {
  for (const tpl of podTemplates(obj)) {
    for (const c of tpl.spec.containers) {
      const e = (c.env || []).find((x) => x.name === "HSBN_JOB_ID");
      if (!e) continue;
      if (e.value !== undefined) return `HSBN_JOB_ID=${e.value}`;
      const ref = e.valueFrom && (e.valueFrom.secretKeyRef || e.valueFrom.configMapKeyRef);
      if (ref) return `HSBN_JOB_ID from ${e.valueFrom.secretKeyRef ? "Secret" : "ConfigMap"} ${ref.name} key ${ref.key}`;
    }
  }
  return `${obj.kind}/${obj.metadata.name}`;
}

function hsbnErrors(objs, contract, shared, isShared) {
  const errors = [];
  const services = objs.filter((o) => o.kind === "Service");
  const templates = objs.flatMap((o) => podTemplates(o).map((t) => [o, t]));
  // Sidecars may point at the shared root's or group tier's Services, deployed by their own
  // kustomizations (and the group aggregators at the root's).
  const upstreamServices = services.concat(shared.filter((o) => o.kind === "Service"));
  const upstreamTemplates = templates.concat(shared.flatMap((o) => podTemplates(o).map((t) => [o, t])));
  const parentOf = (svc) => upstreamTemplates.filter(([, t]) => matches(svc.spec.selector, t.metadata.labels) && roleOf(t));
  // Nodes per training job, and what the tier checks need of each trainer object.
  const jobs = new Map();
  for (const obj of objs.filter((o) => TRAINER_KINDS.includes(o.kind))) {
    const key = trainingJobKey(obj);
    if (!jobs.has(key)) jobs.set(key, { nodes: 0, members: [] });
    jobs.get(key).nodes += nodesOf(obj);
  }
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
      const role = flags["--role"];
      if (!["node", "group", "root"].includes(role)) errors.push(`${cw}: --role must be node, group or root`);
      for (const f of Object.keys(flags)) {
        if (!contract.has(f)) errors.push(`${cw}: ${f} is not in the aggregator's flag contract (deploy/aggregator-flags.txt)`);
        else if (role && !contract.get(f).has(role)) errors.push(`${cw}: ${f} is not for --role=${role} (deploy/aggregator-flags.txt: ${[...contract.get(f)].join(",")})`);
      }
      if (!flags["--listen"]) errors.push(`${cw}: --listen is missing`);
      if (!(c.securityContext && c.securityContext.readOnlyRootFilesystem === true)) errors.push(`${cw}: aggregator must run with readOnlyRootFilesystem: true`);
      if (role === "root" || role === "group") {
        // The root and the group aggregators serve every job: apart from them, hard to evict.
        const what = ROLE_NAME[role];
        if (!isShared) errors.push(`${cw}: a ${what} in a job's manifests; it belongs in deploy/k8s/${role}, so that deleting a job never deletes it`);
        for (const probe of ["startupProbe", "readinessProbe", "livenessProbe"]) if (!c[probe]) errors.push(`${cw}: the ${what} needs a ${probe}`);
        const pc = objs.find((o) => o.kind === "PriorityClass" && o.metadata.name === spec.priorityClassName);
        if (!pc) errors.push(`${where}: the ${what} needs a priorityClassName naming a PriorityClass of its kustomization (has ${JSON.stringify(spec.priorityClassName)})`);
        if (!objs.some((o) => o.kind === "PodDisruptionBudget" && matches(o.spec.selector.matchLabels, tpl.metadata.labels))) errors.push(`${where}: no PodDisruptionBudget selects the ${what}`);
        const anti = (((spec.affinity || {}).podAntiAffinity || {}).preferredDuringSchedulingIgnoredDuringExecution || []).map((w) => w.podAffinityTerm)
          .concat(((spec.affinity || {}).podAntiAffinity || {}).requiredDuringSchedulingIgnoredDuringExecution || []);
        if (!anti.some((t) => t.topologyKey === "kubernetes.io/hostname" && (t.labelSelector.matchLabels || {})["app.kubernetes.io/component"] === "trainer")) errors.push(`${where}: the ${what} needs pod anti-affinity to trainer pods (app.kubernetes.io/component: trainer, per host)`);
      }
      if (role === "group") {
        if (!placement(tpl)) errors.push(`${where}: a group aggregator must be pinned to its rack: a required nodeAffinity with one term, "In" the rack's value of a topology label`);
        if (!flags["--upstream"]) errors.push(`${cw}: a group aggregator needs --upstream=ROOT:PORT (it forwards its groups' global rounds to the root)`);
      }
      if (flags["--upstream"] !== undefined) {
        const [host, port] = flags["--upstream"].split(":");
        const svc = upstreamServices.find((s) => s.metadata.name === host);
        if (!svc) { errors.push(`${cw}: --upstream=${flags["--upstream"]}: no Service named ${host} in this render or the shared root's or group tier's`); continue; }
        if (!svc.spec.ports.some((p) => String(p.port) === port)) errors.push(`${cw}: Service ${host} has no port ${port}`);
        const parents = new Set(parentOf(svc).map(([, t]) => roleOf(t)));
        const want = role === "group" ? ["root"] : ["root", "group"];
        if (!want.some((r) => parents.has(r))) errors.push(`${cw}: Service ${host} selects no pod running ${want.map((r) => `--role=${r}`).join(" or ")}`);
        if (parents.size > 1) errors.push(`${cw}: Service ${host} selects pods of several roles (${[...parents].join(", ")})`);
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
    const job = jobs.get(trainingJobKey(obj));
    const nodes = job.nodes;
    if (nodes > 1 && flagsOf(sidecar)["--upstream"] === undefined) errors.push(`${where}: a multi-node job needs --upstream on its sidecar`);
    // What the tier checks need: which parent the sidecar names, and which nodes these pods are.
    const upHost = (flagsOf(sidecar)["--upstream"] || "").split(":")[0];
    const upSvc = upstreamServices.find((s) => s.metadata.name === upHost);
    const parent = upSvc && parentOf(upSvc)[0];
    const trainer = spec.containers.find((c) => envValue(c, "HSBN_ADDRESS") !== undefined) || spec.containers[0];
    job.members.push({ where, tpl, trainer, svc: upHost, parent: parent && { role: roleOf(parent[1]), tpl: parent[1] },
      count: nodesOf(obj), first: Number(envValue(trainer, "FIRST_NODE_RANK") || 0) });
    for (const c of spec.containers) {
      if (!(c.volumeMounts || []).some((m) => mount && m.name === mount.name && m.mountPath === sockDir)) errors.push(`${where}: container ${c.name} does not mount the socket volume at ${sockDir}`);
      if (envValue(c, "HSBN_ADDRESS") !== listen) errors.push(`${where}: container ${c.name}: HSBN_ADDRESS=${envValue(c, "HSBN_ADDRESS")} but the sidecar listens on ${listen}`);
      if (!(c.env || []).some((e) => e.name === "HSBN_JOB_ID")) errors.push(`${where}: container ${c.name}: HSBN_JOB_ID is not set`);
      const nn = (c.args || []).map((a) => resolveEnv(c, a)).find((a) => a.startsWith("--nnodes="));
      if (nn && Number(nn.split("=")[1]) !== nodes) errors.push(`${where}: container ${c.name}: torchrun ${nn} but the job runs ${nodes} pod(s)`);
    }
    if (obj.kind === "PyTorchJob" && !spec.containers.some((c) => c.name === "pytorch")) errors.push(`${where}: the PyTorchJob's trainer container must be named pytorch (the operator sets its variables there)`);
  }
  for (const [key, job] of jobs) errors.push(...tierErrors(key, job));  for (const svc of services) {
    const sel = svc.spec.selector || {};
    const podLabels = (t) => ({ ...(t.metadata.labels || {}), "batch.kubernetes.io/job-name": undefined });
    const match = templates.some(([o, t]) => Object.entries(sel).every(([k, v]) =>
      (k === "batch.kubernetes.io/job-name" && o.kind === "Job") ? o.metadata.name === v : podLabels(t)[k] === v));
    if (!match) errors.push(`Service/${svc.metadata.name}: selector ${JSON.stringify(sel)} matches no pod template`);
  }
  return errors;
}

// The group tier's rules for one training job whose sidecars name group aggregators: all of
// them do (the root refuses a mix), every trainer sets HSBN_GROUP_NODES=K, K divides the nodes,
// the trainer objects' node ranks (FIRST_NODE_RANK + index, 0 without it) tile 0..nodes-1 with
// each object inside one group, each group has one aggregator and each aggregator one group of
// the job, and a group's nodes are pinned where its aggregator is.
function tierErrors(key, job) {
  const errors = [];
  const tier = job.members.filter((m) => m.parent && m.parent.role === "group");
  if (!tier.length || job.nodes < 2) return errors;
  for (const m of job.members) {
    if (!m.parent || m.parent.role !== "group") errors.push(`${m.where}: its sidecars name ${m.svc || "no upstream"}, but other sidecars of the job (${key}) name group aggregators: either every sidecar of a job goes through a group aggregator or none (the root refuses the mix)`);
  }
  const ks = new Set();
  for (const m of tier) {
    const k = envValue(m.trainer, "HSBN_GROUP_NODES");
    if (k === undefined) errors.push(`${m.where}: container ${m.trainer.name}: HSBN_GROUP_NODES is not set, but its sidecar's upstream ${m.svc} is a group aggregator (every worker needs K, the nodes per group)`);
    else ks.add(k);
  }
  if (ks.size > 1) errors.push(`${key}: HSBN_GROUP_NODES differs between its trainers (${[...ks].join(", ")}); it is one number per job`);
  if (ks.size !== 1) return errors;
  const k = Number([...ks][0]);
  if (!Number.isInteger(k) || k < 1) { errors.push(`${key}: HSBN_GROUP_NODES=${[...ks][0]} is not a positive integer`); return errors; }
  if (job.nodes % k) errors.push(`${key}: HSBN_GROUP_NODES=${k} does not divide the job's ${job.nodes} nodes`);
  const sorted = [...tier].sort((a, b) => a.first - b.first);
  let next = 0;
  const svcOfGroup = new Map(), groupOfSvc = new Map();
  for (const m of sorted) {
    const last = m.first + m.count - 1;
    if (m.first !== next) errors.push(`${m.where}: its nodes ${m.first}..${last} ${m.first < next ? "overlap" : "leave a gap after"} the nodes before (0..${next - 1}); FIRST_NODE_RANK must tile the job's nodes`);
    next = Math.max(next, last + 1);
    const g = Math.floor(m.first / k);
    if (Math.floor(last / k) !== g) errors.push(`${m.where}: its nodes ${m.first}..${last} span groups ${g}..${Math.floor(last / k)} of HSBN_GROUP_NODES=${k}, but its pods name one group aggregator: one Job (pod template) per group`);
    if (svcOfGroup.has(g) && svcOfGroup.get(g) !== m.svc) errors.push(`${m.where}: group ${g}'s nodes name two group aggregators (${svcOfGroup.get(g)}, ${m.svc})`);
    svcOfGroup.set(g, m.svc);
    if (groupOfSvc.has(m.svc) && groupOfSvc.get(m.svc) !== g) errors.push(`${m.where}: group aggregator ${m.svc} would serve groups ${groupOfSvc.get(m.svc)} and ${g} of job ${key}; it serves one group per job`);
    groupOfSvc.set(m.svc, g);
    const mine = placement(m.tpl), theirs = placement(m.parent.tpl);
    if (mine !== theirs) errors.push(`${m.where}: its nodes are placed by ${mine || "no required nodeAffinity"}, its group aggregator ${m.svc} by ${theirs}: a group's nodes and its aggregator belong in one rack`);
  }
  if (next !== job.nodes) errors.push(`${key}: node ranks 0..${next - 1}, but the job has ${job.nodes} nodes`);
  return errors;
}

// What is rendered: the shared root and group tier, the overlays (root-* and group-* ones are
// those too), the examples.
function targets(k8sDir) {
  const list = (d) => fs.existsSync(path.join(k8sDir, d)) ? fs.readdirSync(path.join(k8sDir, d)).sort().map((x) => `${d}/${x}`) : [];
  return ["root", "group", ...list("overlays"), ...list("examples")];
}
const isRootTarget = (t) => t === "root" || /^overlays\/root/.test(t);
const isGroupTarget = (t) => t === "group" || /^overlays\/group/.test(t);

function validateTree(k8sDir, only) {
  const contract = loadFlagContract(k8sDir);
  // The shared parents; one that does not render is reported as its own target.
  const renderOrNone = (d) => { try { return render(path.join(k8sDir, d)); } catch (e) { return []; } };
  const root = renderOrNone("root");
  const group = renderOrNone("group");
  const report = [];
  for (const t of only || targets(k8sDir)) {
    let objs;
    try { objs = render(path.join(k8sDir, t)); } catch (e) { report.push({ target: t, errors: [`kustomize failed: ${(e.stderr || e.message).toString().split("\n")[0]}`], count: 0 }); continue; }
    // A root has no parent; a group aggregator's is the root; a job's sidecars either.
    const shared = isRootTarget(t) ? [] : isGroupTarget(t) ? root : root.concat(group);
    const errors = objs.flatMap(schemaErrors).concat(hsbnErrors(objs, contract, shared, isRootTarget(t) || isGroupTarget(t)));
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
  ["group", "group/rack-b/kustomization.yaml", "nameSuffix: -rack-b", "nameSuffix: -rack-a", "kustomize failed"],
  ["overlays/multi-node-tier", "overlays/multi-node-tier/group-1/kustomization.yaml", "value: \"2\"", "value: \"1\"", "overlap"],
  ["examples/pytorchjob", "examples/pytorchjob/pytorchjob.yaml", "  nprocPerNode: \"8\"", "  nprocPerNode: 8", "/nprocPerNode must be string, not integer"],
];
const find = (objs, kind, name) => objs.find((o) => o.kind === kind && o.metadata.name === name);
const job = (b) => find(b.job, "Job", "hsbn-train").spec.template.spec;
const sidecar = (b) => job(b).initContainers[0];
const trainer = (b) => job(b).containers[0];
const root = (b) => find(b.root, "Deployment", "hsbn-root").spec.template;
const ptj = (b) => find(b.pytorchjob, "PyTorchJob", "hsbn-train").spec;
const jset = (b) => find(b.jobset, "JobSet", "hsbn-train").spec;
const grp = (b) => find(b.group, "Deployment", "hsbn-group-rack-a").spec.template;
const tier = (b, g) => find(b.tier, "Job", `hsbn-train-g${g}`).spec.template.spec;
const setUpstream = (c, to) => { c.args = c.args.map((a) => a.startsWith("--upstream=") ? `--upstream=${to}` : a); };
const setEnv = (c, name, value) => { c.env.find((e) => e.name === name).value = value; };
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
  ["a flag of another role", (b) => { root(b).spec.containers[0].args.push("--upstream-ca=/etc/hsbn/tls/ca.crt"); }, "--upstream-ca is not for --role=root"],
  ["an unknown role", (b) => { setUpstream(sidecar(b), "hsbn-root:7070"); sidecar(b).args[0] = "--role=rack"; }, "--role must be node, group or root"],
  ["group aggregator without a PodDisruptionBudget", (b) => { b.group = b.group.filter((o) => o.kind !== "PodDisruptionBudget"); }, "no PodDisruptionBudget selects the group aggregator"],
  ["group aggregator without a PriorityClass", (b) => { b.group = b.group.filter((o) => o.kind !== "PriorityClass"); }, "the group aggregator needs a priorityClassName"],
  ["group aggregator without readiness probe", (b) => { delete grp(b).spec.containers[0].readinessProbe; }, "the group aggregator needs a readinessProbe"],
  ["group aggregator next to trainers", (b) => { delete grp(b).spec.affinity.podAntiAffinity; }, "the group aggregator needs pod anti-affinity"],
  ["group aggregator not pinned to a rack", (b) => { delete grp(b).spec.affinity.nodeAffinity; }, "must be pinned to its rack"],
  ["group aggregator without upstream", (b) => { const c = grp(b).spec.containers[0]; c.args = c.args.filter((a) => !a.startsWith("--upstream=")); }, "a group aggregator needs --upstream"],
  ["group aggregator under another group aggregator", (b) => { setUpstream(grp(b).spec.containers[0], "hsbn-group-rack-b:7070"); }, "selects no pod running --role=root"],
  ["group aggregator inside a job's manifests", (b) => { b.tier.push(JSON.parse(JSON.stringify(find(b.group, "Deployment", "hsbn-group-rack-a")))); }, "a group aggregator in a job's manifests"],
  ["group Service selects nothing", (b) => { grp(b).metadata.labels["app.kubernetes.io/instance"] = "elsewhere"; }, "selects no pod running --role=root or --role=group"],
  ["tier trainer without HSBN_GROUP_NODES", (b) => { const c = tier(b, 1).containers[0]; c.env = c.env.filter((e) => e.name !== "HSBN_GROUP_NODES"); }, "HSBN_GROUP_NODES is not set"],
  ["tier trainers disagree on K", (b) => { setEnv(tier(b, 1).containers[0], "HSBN_GROUP_NODES", "4"); }, "HSBN_GROUP_NODES differs"],
  ["K does not divide the nodes", (b) => { for (const g of [0, 1]) setEnv(tier(b, g).containers[0], "HSBN_GROUP_NODES", "3"); }, "HSBN_GROUP_NODES=3 does not divide the job's 4 nodes"],
  ["one Job spans two groups", (b) => { for (const g of [0, 1]) setEnv(tier(b, g).containers[0], "HSBN_GROUP_NODES", "1"); }, "span groups 0..1"],
  ["two groups at one group aggregator", (b) => { setUpstream(tier(b, 1).initContainers[0], "hsbn-group-rack-a:7070"); }, "serves one group per job"],
  ["a group's nodes in another rack", (b) => { tier(b, 1).affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].values = ["rack-a"]; }, "belong in one rack"],
  ["a group's nodes not pinned", (b) => { delete tier(b, 0).affinity; }, "placed by no required nodeAffinity"],
  ["a tier job's sidecar at the root", (b) => { setUpstream(tier(b, 1).initContainers[0], "hsbn-root:7070"); }, "or none (the root refuses the mix)"],
  ["tier node ranks leave a gap", (b) => { setEnv(tier(b, 1).containers[0], "FIRST_NODE_RANK", "4"); }, "leave a gap"],
  ["tier nnodes != pods", (b) => { const j = find(b.tier, "Job", "hsbn-train-g1"); j.spec.completions = j.spec.parallelism = 4; }, "--nnodes=4 but the job runs 6"],
];

function bundleErrors(b, contract) {
  const errs = (objs, shared, isRoot) => objs.flatMap(schemaErrors).concat(hsbnErrors(objs, contract, shared, isRoot));
  const parents = b.root.concat(b.group);
  return [...errs(b.root, [], true), ...errs(b.rootSecure, [], true), ...errs(b.group, b.root, true),
    ...errs(b.job, parents, false), ...errs(b.tier, parents, false),
    ...errs(b.pytorchjob, parents, false), ...errs(b.jobset, parents, false)];
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
    group: render(path.join(k8sDir, "group")), tier: render(path.join(k8sDir, "overlays", "multi-node-tier")),
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
