{{/* Names of the chart's objects, all derived from the release name. */}}
{{- define "strata.fullname" -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "strata.engineName" -}}{{ include "strata.fullname" . }}-engine{{- end -}}
{{- define "strata.pickerName" -}}{{ include "strata.fullname" . }}-epp{{- end -}}
{{- define "strata.controllerName" -}}{{ include "strata.fullname" . }}-controller{{- end -}}

{{- define "strata.poolName" -}}
{{- default (printf "%s-pool" (include "strata.fullname" .)) .Values.pool.name -}}
{{- end -}}

{{- define "strata.gatewayName" -}}
{{- if .Values.gateway.enabled -}}
{{ include "strata.fullname" . }}-gateway
{{- else -}}
{{ required "gateway.existingName is needed when gateway.enabled is false" .Values.gateway.existingName }}
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

{{/* The labels the InferencePool selects the engine pods by. */}}
{{- define "strata.engineSelector" -}}
app.kubernetes.io/name: {{ include "strata.engineName" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "strata.pickerSelector" -}}
app.kubernetes.io/name: {{ include "strata.pickerName" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "strata.controllerSelector" -}}
app.kubernetes.io/name: {{ include "strata.controllerName" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The engine pod template (shared by the Deployment and the LeaderWorkerSet leader). */}}
{{- define "strata.enginePod" -}}
metadata:
  labels:
    {{- include "strata.engineSelector" . | nindent 4 }}
    {{- include "strata.labels" . | nindent 4 }}
    inference.networking.k8s.io/engine-type: {{ .Values.engine.kind }}
  {{- if .Values.engine.kvEvents.enabled }}
  annotations:
    strata.dev/kv-events: {{ .Values.engine.kvEvents.port | quote }}
  {{- end }}
spec:
  {{- with .Values.engine.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.engine.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  terminationGracePeriodSeconds: 60
  containers:
  - name: engine
    {{- if eq .Values.engine.kind "strata" }}
    image: {{ include "strata.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    args:
    - engine
    - --host
    - 0.0.0.0
    - --port
    - {{ .Values.engine.port | quote }}
    - --model
    - {{ .Values.model | quote }}
    {{- range .Values.engine.strataArgs }}
    - {{ . | quote }}
    {{- end }}
    {{- else }}
    image: {{ .Values.engine.image }}
    args:
    {{- range .Values.engine.args }}
    - {{ . | quote }}
    {{- end }}
    - --model
    - {{ .Values.model | quote }}
    - --port
    - {{ .Values.engine.port | quote }}
    {{- if and .Values.engine.kvEvents.enabled (eq .Values.engine.kind "vllm") }}
    - --kv-events-config
    - {{ printf "{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:%v\", \"topic\": \"kv@$(POD_IP)@%s\"}" .Values.engine.kvEvents.port .Values.model | quote }}
    {{- end }}
    {{- end }}
    env:
    - name: POD_IP
      valueFrom:
        fieldRef:
          fieldPath: status.podIP
    {{- with .Values.engine.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    ports:
    - name: http
      containerPort: {{ .Values.engine.port }}
      protocol: TCP
    {{- if .Values.engine.kvEvents.enabled }}
    - name: kv-events
      containerPort: {{ .Values.engine.kvEvents.port }}
      protocol: TCP
    {{- end }}
    readinessProbe:
      httpGet:
        path: /health
        port: http
      periodSeconds: 5
      failureThreshold: 3
    startupProbe:
      httpGet:
        path: /health
        port: http
      periodSeconds: 10
      failureThreshold: 60
    {{- with .Values.engine.resources }}
    resources:
      {{- toYaml . | nindent 6 }}
    {{- end }}
{{- end -}}

{{/* The InferencePool's selector: the engine pods; for a LeaderWorkerSet only the group
leaders (worker index 0), which serve. */}}
{{- define "strata.poolSelector" -}}
{{ include "strata.engineSelector" . }}
{{- if eq .Values.engine.workload "LeaderWorkerSet" }}
leaderworkerset.sigs.k8s.io/worker-index: "0"
{{- end }}
{{- end -}}
