{{/* Names of the chart's objects, all derived from the release name. */}}
{{- define "strata.fullname" -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "strata.engineName" -}}{{ include "strata.fullname" . }}-engine{{- end -}}
{{- define "strata.pickerName" -}}{{ include "strata.fullname" . }}-epp{{- end -}}
{{- define "strata.controllerName" -}}{{ include "strata.fullname" . }}-controller{{- end -}}
{{- define "strata.apiGatewayName" -}}{{ include "strata.fullname" . }}-strata-gateway{{- end -}}
{{- define "strata.redisName" -}}{{ include "strata.fullname" . }}-redis{{- end -}}
{{- define "strata.postgresName" -}}{{ include "strata.fullname" . }}-postgres{{- end -}}

{{- define "strata.poolName" -}}
{{- default (printf "%s-pool" (include "strata.fullname" .)) .Values.pool.name -}}
{{- end -}}

{{- define "strata.gatewayName" -}}
{{- if .Values.gateway.enabled -}}
{{ include "strata.fullname" . }}-gateway
{{- else -}}
{{ required "gateway.existingName is needed when gateway.enabled is false (or set httpRoute.enabled: false with strataGateway.enabled: true)" .Values.gateway.existingName }}
{{- end -}}
{{- end -}}

{{- define "strata.image" -}}{{ .Values.image.repository }}:{{ .Values.image.tag }}{{- end -}}

{{/* Labels of every object and pod; pods add their selector labels (which carry the
instance), top-level objects use strata.metaLabels. */}}
{{- define "strata.labels" -}}
app.kubernetes.io/part-of: strata
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{- define "strata.metaLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
{{ include "strata.labels" . }}
{{- end -}}

{{/* Selector labels of one component: (dict "root" $ "name" NAME). */}}
{{- define "strata.selector" -}}
app.kubernetes.io/name: {{ .name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- end -}}

{{- define "strata.pickerSelector" -}}
{{ include "strata.selector" (dict "root" . "name" (include "strata.pickerName" .)) }}
{{- end -}}

{{- define "strata.controllerSelector" -}}
{{ include "strata.selector" (dict "root" . "name" (include "strata.controllerName" .)) }}
{{- end -}}

{{/* The role label llm-d's prefill/decode profile reads on a pod. */}}
{{- define "strata.roleLabel" -}}llm-d.ai/role{{- end -}}

{{/* The served models, as a YAML list of dicts with every name resolved. Without
`models`, one model from the top-level `model` and `engine` values, under the names the
chart always used (<release>-engine, <release>-pool, <release>-epp, <release>-controller,
the route <release>); with `models`, one set per entry, named <release>-<name>-... . */}}
{{- define "strata.models" -}}
{{- $full := include "strata.fullname" . -}}
{{- $out := list -}}
{{- if not .Values.models -}}
{{- $e := deepCopy .Values.engine -}}
{{- $out = append $out (dict "key" "" "model" .Values.model "engineName" (printf "%s-engine" $full) "poolName" (include "strata.poolName" .) "pickerName" (printf "%s-epp" $full) "controllerName" (printf "%s-controller" $full) "routeName" $full "engine" $e "gateway" (deepCopy .Values.strataGateway.modelDefaults)) -}}
{{- else -}}
{{- $seen := dict -}}
{{- range $i, $m := .Values.models -}}
{{- $name := required (printf "models[%d].name is required" $i) $m.name -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" $name) -}}
{{- fail (printf "models[%d].name %q must be a DNS label (lower-case letters, digits, '-')" $i $name) -}}
{{- end -}}
{{- if hasKey $seen $name -}}
{{- fail (printf "models: the name %q is used twice" $name) -}}
{{- end -}}
{{- $_ := set $seen $name true -}}
{{- $served := required (printf "models[%d].model (the model id clients send) is required" $i) $m.model -}}
{{- $e := mergeOverwrite (deepCopy $.Values.engine) (deepCopy ($m.engine | default dict)) -}}
{{- if hasKey $m "adapters" }}{{ $_ := set $e "adapters" $m.adapters }}{{ end -}}
{{- if hasKey $m "replicas" }}{{ $_ := set $e "replicas" $m.replicas }}{{ end -}}
{{- $gw := mergeOverwrite (deepCopy $.Values.strataGateway.modelDefaults) (deepCopy ($m.gateway | default dict)) -}}
{{- $canary := deepCopy ($m.canary | default dict) -}}
{{- if $canary -}}
{{- $of := required (printf "models[%d].canary.of (the model it is a canary of) is required" $i) $canary.of -}}
{{- if $canary.analysis -}}
{{- /* The controller moves the share by the route's weights; the gateway gives none. */ -}}
{{- if and (hasKey $canary "weight") (ne (int $canary.weight) 0) -}}
{{- fail (printf "models[%d].canary: with analysis the controller moves the share (HTTPRoute weights); leave weight out" $i) -}}
{{- end -}}
{{- if not (and $.Values.httpRoute.enabled $.Values.controller.enabled) -}}
{{- fail (printf "models[%d].canary.analysis needs httpRoute.enabled and controller.enabled (the controller moves the route's weights)" $i) -}}
{{- end -}}
{{- if and $.Values.strataGateway.enabled (ne $.Values.strataGateway.upstream "gatewayApi") -}}
{{- fail (printf "models[%d].canary.analysis needs strataGateway.upstream gatewayApi (the route's weights steer only traffic through the Gateway API gateway)" $i) -}}
{{- end -}}
{{- $_ := set $canary "weight" 0 -}}
{{- else -}}
{{- $w := int (required (printf "models[%d].canary.weight (0 to 100) is required" $i) (toString $canary.weight)) -}}
{{- if or (lt $w 0) (gt $w 100) -}}
{{- fail (printf "models[%d].canary.weight must be 0 to 100" $i) -}}
{{- end -}}
{{- end -}}
{{- $found := false -}}
{{- range $.Values.models -}}
{{- if and (eq .name $of) (not .canary) }}{{ $found = true }}{{ end -}}
{{- end -}}
{{- if not $found -}}
{{- fail (printf "models[%d].canary.of %q names no model entry that is not itself a canary" $i $of) -}}
{{- end -}}
{{- end -}}
{{- $d := dict "key" $name "canary" $canary "model" $served "engineName" (printf "%s-%s-engine" $full $name) "poolName" (default (printf "%s-%s-pool" $full $name) $m.poolName) "pickerName" (printf "%s-%s-epp" $full $name) "controllerName" (printf "%s-%s-controller" $full $name) "routeName" (printf "%s-%s" $full $name) "engine" $e "gateway" $gw -}}
{{- range $k := list "engineName" "poolName" "pickerName" "controllerName" -}}
{{- if gt (len (get $d $k)) 63 -}}
{{- fail (printf "models[%d]: %s %q is longer than 63 characters; use a shorter release or model name" $i $k (get $d $k)) -}}
{{- end -}}
{{- end -}}
{{- $out = append $out $d -}}
{{- end -}}
{{- end -}}
{{- range $out -}}
{{- $e := .engine -}}
{{- if not (has $e.workload (list "Deployment" "LeaderWorkerSet")) -}}
{{- fail "engine.workload must be Deployment or LeaderWorkerSet" -}}
{{- end -}}
{{- if $e.pd.enabled -}}
{{- if not (has $e.kind (list "vllm" "strata")) -}}
{{- fail "engine.pd needs engine.kind vllm or strata (the engines with a KV-transfer path the chart wires)" -}}
{{- end -}}
{{- if ne $e.workload "Deployment" -}}
{{- fail "engine.pd needs engine.workload Deployment" -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* The engine pods' selector labels of one model: (dict "root" $ "m" MODEL). */}}
{{- define "strata.engineSelector" -}}
{{ include "strata.selector" (dict "root" .root "name" .m.engineName) }}
{{- end -}}

{{/* The InferencePool's selector: the engine pods; for a LeaderWorkerSet only the group
leaders (worker index 0), which serve. Prefill and decode pods are both in the pool: the
picker tells them apart by their role label. */}}
{{/* A pool's pods as a label selector string (`k=v,k=v`), as the rollout API lists them. */}}
{{- define "strata.poolSelectorString" -}}
{{- $labels := include "strata.poolSelector" . | fromYaml -}}
{{- $parts := list -}}
{{- range $k := keys $labels | sortAlpha -}}
{{- $parts = append $parts (printf "%s=%v" $k (get $labels $k)) -}}
{{- end -}}
{{- join "," $parts -}}
{{- end -}}

{{- define "strata.poolSelector" -}}
{{ include "strata.engineSelector" . }}
{{- if eq .m.engine.workload "LeaderWorkerSet" }}
leaderworkerset.sigs.k8s.io/worker-index: "0"
{{- end }}
{{- end -}}

{{/* The restrictive container securityContext every container gets. */}}
{{- define "strata.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: {{ .Values.security.uid }}
runAsGroup: {{ .Values.security.uid }}
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "strata.podSecurity" -}}
runAsNonRoot: true
runAsUser: {{ .Values.security.uid }}
runAsGroup: {{ .Values.security.uid }}
fsGroup: {{ .Values.security.uid }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* The Strata gateway's upstream for one model: (dict "root" $ "m" MODEL). */}}
{{- define "strata.upstreamUrl" -}}
{{- $r := .root -}}
{{- if eq $r.Values.strataGateway.upstream "router" -}}
{{ if $r.Values.tls.enabled }}https{{ else }}http{{ end }}://{{ .m.pickerName }}.{{ $r.Release.Namespace }}.svc:{{ $r.Values.picker.httpPort }}
{{- else -}}
{{- $svc := default (include "strata.gatewayName" $r) $r.Values.strataGateway.gatewayApiService.name -}}
http://{{ $svc }}.{{ default $r.Release.Namespace $r.Values.strataGateway.gatewayApiService.namespace }}.svc:{{ $r.Values.strataGateway.gatewayApiService.port }}{{ if .m.key }}/models/{{ .m.key }}{{ end }}
{{- end -}}
{{- end -}}

{{/* Whether the pickers serve the HTTP front (the Strata gateway's "router" upstream). */}}
{{- define "strata.pickerHttp" -}}
{{- if and .Values.strataGateway.enabled (eq .Values.strataGateway.upstream "router") -}}true{{- end -}}
{{- end -}}

{{/* A generated secret value that stays the same across upgrades and is generated once
per render: (dict "root" $ "secret" NAME "key" KEY). */}}
{{- define "strata.generated" -}}
{{- $memo := printf "__generated/%s/%s" .secret .key -}}
{{- $cache := .root.Values -}}
{{- if not (hasKey $cache $memo) -}}
{{- $value := randAlphaNum 32 -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .secret -}}
{{- if and $existing $existing.data (hasKey $existing.data .key) -}}
{{- $value = index $existing.data .key | b64dec -}}
{{- end -}}
{{- $_ := set $cache $memo $value -}}
{{- end -}}
{{- index $cache $memo -}}
{{- end -}}

{{- define "strata.redisUrl" -}}
{{- if .Values.redis.enabled -}}
redis://{{ include "strata.redisName" . }}.{{ .Release.Namespace }}.svc:{{ .Values.redis.port }}/
{{- else -}}
{{- .Values.redis.url -}}
{{- end -}}
{{- end -}}

{{- define "strata.postgresPassword" -}}
{{- include "strata.generated" (dict "root" . "secret" (include "strata.postgresName" .) "key" "password") -}}
{{- end -}}

{{- define "strata.postgresUrl" -}}
{{- if .Values.postgres.enabled -}}
postgres://{{ .Values.postgres.user }}:{{ include "strata.postgresPassword" . }}@{{ include "strata.postgresName" . }}.{{ .Release.Namespace }}.svc:{{ .Values.postgres.port }}/{{ .Values.postgres.database }}
{{- else -}}
{{- .Values.postgres.url -}}
{{- end -}}
{{- end -}}

{{/* Readiness and liveness probes on an HTTP /health port name: (dict "port" NAME
"tls" BOOL); over HTTPS with tls (the kubelet does not verify the certificate). */}}
{{- define "strata.httpProbes" -}}
readinessProbe:
  httpGet:
    path: /health
    port: {{ .port }}
    {{- if .tls }}
    scheme: HTTPS
    {{- end }}
  periodSeconds: 5
  failureThreshold: 3
livenessProbe:
  httpGet:
    path: /health
    port: {{ .port }}
    {{- if .tls }}
    scheme: HTTPS
    {{- end }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- end -}}

{{/* TLS (tls.*): where every component finds its files. */}}
{{- define "strata.tlsDir" -}}/etc/strata-tls{{- end -}}

{{/* The Secret with the TLS files of one component: (dict "root" $ "component" "picker"|
"controller"|"strataGateway" "object" NAME). cert-manager's Certificate is <object>-tls;
otherwise the component's existingSecret, required. */}}
{{- define "strata.tlsSecret" -}}
{{- $t := .root.Values.tls -}}
{{- $existing := (get $t .component).existingSecret -}}
{{- if $existing -}}
{{- $existing -}}
{{- else if $t.certManager.enabled -}}
{{- .object }}-tls
{{- else -}}
{{- fail (printf "tls.enabled needs tls.certManager.enabled or tls.%s.existingSecret" .component) -}}
{{- end -}}
{{- end -}}

{{/* The read-only mount of the TLS files. */}}
{{- define "strata.tlsMount" -}}
- name: tls
  mountPath: {{ include "strata.tlsDir" . }}
  readOnly: true
{{- end -}}

{{/* The volume of one component's TLS Secret: (dict "root" $ "component" C "object" NAME). */}}
{{- define "strata.tlsVolume" -}}
- name: tls
  secret:
    secretName: {{ include "strata.tlsSecret" . }}
{{- end -}}

{{/* The engines' TLS volume: an existing Secret, or cert-manager's CSI driver issuing a
certificate per pod for its IP and name. */}}
{{- define "strata.engineTlsVolume" -}}
{{- $t := .Values.tls -}}
- name: tls
{{- if $t.engine.existingSecret }}
  secret:
    secretName: {{ $t.engine.existingSecret }}
{{- else if $t.certManager.enabled }}
  csi:
    driver: csi.cert-manager.io
    readOnly: true
    volumeAttributes:
      csi.cert-manager.io/issuer-name: {{ required "tls.certManager.issuerRef.name is required" $t.certManager.issuerRef.name }}
      csi.cert-manager.io/issuer-kind: {{ $t.certManager.issuerRef.kind }}
      csi.cert-manager.io/issuer-group: {{ $t.certManager.issuerRef.group }}
      csi.cert-manager.io/ip-sans: ${POD_IP}
      csi.cert-manager.io/dns-names: ${POD_NAME}.${POD_NAMESPACE}.pod
      csi.cert-manager.io/duration: {{ $t.certManager.duration }}
      csi.cert-manager.io/renew-before: {{ $t.certManager.renewBefore }}
      csi.cert-manager.io/fs-group: {{ .Values.security.uid | quote }}
{{- else }}
{{- fail "tls.enabled needs tls.certManager.enabled (the CSI driver) or tls.engine.existingSecret" }}
{{- end }}
{{- end -}}
