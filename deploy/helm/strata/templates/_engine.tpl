{{/* The engine pod template of one model: (dict "root" $ "m" MODEL "role" ""|"prefill"|"decode").
Shared by the Deployment(s) and the LeaderWorkerSet's leader and workers. */}}
{{- define "strata.enginePod" -}}
{{- $r := .root -}}
{{- $m := .m -}}
{{- $e := .m.engine -}}
{{- $role := .role -}}
{{- $gpu := and (ne $e.kind "strata") (gt (int $e.gpu.count) 0) -}}
{{- $tls := $r.Values.tls.enabled -}}
{{- $tlsDir := include "strata.tlsDir" $r -}}
{{- if and $tls (not (has $e.kind (list "strata" "vllm"))) -}}
{{- fail "tls.enabled needs engine.kind strata or vllm (the engines whose TLS flags the chart wires)" -}}
{{- end -}}
metadata:
  labels:
    {{- include "strata.engineSelector" . | nindent 4 }}
    {{- include "strata.labels" $r | nindent 4 }}
    inference.networking.k8s.io/engine-type: {{ $e.kind }}
    {{- if $role }}
    {{ include "strata.roleLabel" $r }}: {{ $role }}
    {{- end }}
  {{- if $e.kvEvents.enabled }}
  annotations:
    strata.dev/kv-events: {{ $e.kvEvents.port | quote }}
  {{- end }}
spec:
  securityContext:
    {{- include "strata.podSecurity" $r | nindent 4 }}
  automountServiceAccountToken: false
  {{- with $e.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if or $e.tolerations (and $gpu $e.gpu.tolerate) }}
  tolerations:
    {{- with $e.tolerations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- if and $gpu $e.gpu.tolerate }}
    - key: {{ $e.gpu.resource }}
      operator: Exists
      effect: NoSchedule
    {{- end }}
  {{- end }}
  {{- with $e.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  terminationGracePeriodSeconds: 60
  containers:
  - name: engine
    {{- if eq $e.kind "strata" }}
    image: {{ include "strata.image" $r }}
    imagePullPolicy: {{ $r.Values.image.pullPolicy }}
    args:
    - engine
    - --host
    - 0.0.0.0
    - --port
    - {{ $e.port | quote }}
    - --model
    - {{ $m.model | quote }}
    {{- if $e.adapters }}
    - --enable-lora
    - --max-loras
    - {{ len $e.adapters | quote }}
    - --lora-modules
    {{- range $e.adapters }}
    - {{ printf "%s=%s" .name .source | quote }}
    {{- end }}
    {{- end }}
    {{- if eq $role "prefill" }}
    - --kv-role
    - prefill
    - --kv-transfer-port
    - {{ $e.pd.kvTransferPort | quote }}
    - --kv-transfer-host
    - $(POD_IP)
    {{- else if eq $role "decode" }}
    - --kv-role
    - decode
    - --kv-peers
    - {{ $e.pd.kvPeers | quote }}
    {{- end }}
    {{- if $tls }}
    - --tls-cert
    - {{ $tlsDir }}/tls.crt
    - --tls-key
    - {{ $tlsDir }}/tls.key
    {{- if $role }}
    # Block transfer over mutual TLS, and the x-prefiller-host-port phase 1 over TLS.
    - --kv-tls
    - --kv-tls-ca
    - {{ $tlsDir }}/ca.crt
    {{- end }}
    {{- end }}
    {{- range $e.strataArgs }}
    - {{ . | quote }}
    {{- end }}
    {{- else }}
    image: {{ $e.image }}
    imagePullPolicy: {{ $r.Values.image.pullPolicy }}
    args:
    {{- range $e.args }}
    - {{ . | quote }}
    {{- end }}
    - --model
    - {{ $m.model | quote }}
    - --port
    - {{ $e.port | quote }}
    {{- if and $e.kvEvents.enabled (eq $e.kind "vllm") }}
    - --kv-events-config
    - {{ printf "{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:%v\", \"topic\": \"kv@$(POD_IP)@%s\"}" $e.kvEvents.port $m.model | quote }}
    {{- end }}
    {{- if and $e.adapters (eq $e.kind "vllm") }}
    - --enable-lora
    - --max-loras
    - {{ len $e.adapters | quote }}
    - --lora-modules
    {{- range $e.adapters }}
    - {{ printf "%s=%s" .name .source | quote }}
    {{- end }}
    {{- end }}
    {{- if $tls }}
    - --ssl-certfile
    - {{ $tlsDir }}/tls.crt
    - --ssl-keyfile
    - {{ $tlsDir }}/tls.key
    {{- end }}
    {{- if $role }}
    - --kv-transfer-config
    - {{ printf "{\"kv_connector\": \"NixlConnector\", \"kv_role\": \"kv_both\"}" | quote }}
    {{- end }}
    {{- end }}
    env:
    - name: POD_IP
      valueFrom:
        fieldRef:
          fieldPath: status.podIP
    # Every cache a process writes goes to the writable volumes below (the root
    # filesystem is read-only).
    - name: HOME
      value: /cache
    # The uid has no /etc/passwd entry: Python's getpass.getuser() (torch's compile
    # caches) reads these first.
    - name: USER
      value: strata
    - name: LOGNAME
      value: strata
    - name: XDG_CACHE_HOME
      value: /cache
    - name: HF_HOME
      value: /cache/huggingface
    - name: STRATA_HOME
      value: /cache/strata
    - name: VLLM_CACHE_ROOT
      value: /cache/vllm
    - name: TRITON_CACHE_DIR
      value: /cache/triton
    - name: TMPDIR
      value: /tmp
    {{- if and $role (ne $e.kind "strata") }}
    # NIXL's side channel, where a decoder asks a prefill engine for its blocks.
    - name: VLLM_NIXL_SIDE_CHANNEL_HOST
      value: $(POD_IP)
    - name: VLLM_NIXL_SIDE_CHANNEL_PORT
      value: {{ $e.pd.kvTransferPort | quote }}
    {{- end }}
    {{- with $e.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    ports:
    - name: http
      containerPort: {{ $e.port }}
      protocol: TCP
    {{- if $e.kvEvents.enabled }}
    - name: kv-events
      containerPort: {{ $e.kvEvents.port }}
      protocol: TCP
    {{- end }}
    {{- if $role }}
    - name: kv-transfer
      containerPort: {{ $e.pd.kvTransferPort }}
      protocol: TCP
    {{- end }}
    securityContext:
      {{- include "strata.containerSecurity" $r | nindent 6 }}
    readinessProbe:
      httpGet:
        path: /health
        port: http
        {{- if $tls }}
        scheme: HTTPS
        {{- end }}
      periodSeconds: 5
      failureThreshold: 3
    livenessProbe:
      httpGet:
        path: /health
        port: http
        {{- if $tls }}
        scheme: HTTPS
        {{- end }}
      periodSeconds: 10
      timeoutSeconds: 5
      failureThreshold: 6
    startupProbe:
      httpGet:
        path: /health
        port: http
        {{- if $tls }}
        scheme: HTTPS
        {{- end }}
      periodSeconds: 10
      failureThreshold: {{ $e.startupFailureThreshold }}
    {{- $res := deepCopy ($e.resources | default dict) }}
    {{- if $gpu }}
    {{- $limits := $res.limits | default dict }}
    {{- $_ := set $limits $e.gpu.resource (int $e.gpu.count) }}
    {{- $_ := set $res "limits" $limits }}
    {{- $requests := $res.requests | default dict }}
    {{- $_ := set $requests $e.gpu.resource (int $e.gpu.count) }}
    {{- $_ := set $res "requests" $requests }}
    {{- end }}
    resources:
      {{- toYaml $res | nindent 6 }}
    volumeMounts:
    - name: tmp
      mountPath: /tmp
    - name: cache
      mountPath: /cache
    - name: shm
      mountPath: /dev/shm
    {{- if $tls }}
    {{- include "strata.tlsMount" $r | nindent 4 }}
    {{- end }}
  volumes:
  - name: tmp
    emptyDir: {}
  - name: cache
    {{- if $e.cache.existingClaim }}
    persistentVolumeClaim:
      claimName: {{ $e.cache.existingClaim }}
    {{- else if $e.cache.sizeLimit }}
    emptyDir:
      sizeLimit: {{ $e.cache.sizeLimit }}
    {{- else }}
    emptyDir: {}
    {{- end }}
  - name: shm
    emptyDir:
      medium: Memory
      sizeLimit: {{ $e.shmSize }}
  {{- if $tls }}
  {{- include "strata.engineTlsVolume" $r | nindent 2 }}
  {{- end }}
{{- end -}}
