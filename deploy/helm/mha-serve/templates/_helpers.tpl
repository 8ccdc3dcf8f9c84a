{{- define "mha-serve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "mha-serve.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: mha-serve
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "mha-serve.selector" -}}
app.kubernetes.io/component: server
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "mha-serve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "mha-serve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "mha-serve.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag -}}
{{- end -}}
{{- end -}}

{{- define "mha-serve.claimName" -}}
{{- default (ternary "mha-checkpoints" "mha-model-repository" (eq .Values.model.source "checkpoint")) .Values.model.claim.name -}}
{{- end -}}

{{- define "mha-serve.config" -}}
{{- $config := deepCopy .Values.config -}}
{{- /* `mha tune`'s config.env, as written (helm --set-file tuned=config.env): its MHA_* lines win */ -}}
{{- range $line := splitList "\n" (.Values.tuned | default "") -}}
{{- $line = trim $line -}}
{{- if and $line (not (hasPrefix "#" $line)) (contains "=" $line) -}}
{{- $pair := splitn "=" 2 $line -}}
{{- $_ := set $config (trim $pair._0) (trim $pair._1) -}}
{{- end -}}
{{- end -}}
{{- if .Values.auth.tokenSecret -}}
{{- $_ := set $config "MHA_AUTH_TOKEN_FILE" "/etc/mha-serve/tokens/token" -}}
{{- end -}}
{{- if .Values.auth.adminTokenSecret -}}
{{- $_ := set $config "MHA_ADMIN_TOKEN_FILE" "/etc/mha-serve/tokens/admin-token" -}}
{{- end -}}
{{- if .Values.tls.secret -}}
{{- $_ := set $config "MHA_TLS_CERT" "/etc/mha-serve/tls/tls.crt" -}}
{{- $_ := set $config "MHA_TLS_KEY" "/etc/mha-serve/tls/tls.key" -}}
{{- $_ := set $config "MHA_HEALTH_PORT" "8003" -}}
{{- end -}}
{{- if .Values.tls.clientSecret -}}
{{- $_ := set $config "MHA_TLS_CLIENT_CA" "/etc/mha-serve/tls/ca.crt" -}}
{{- end -}}
{{- if eq .Values.model.source "checkpoint" -}}
{{- $_ := set $config "MHA_MODEL_DIR" "/models/custom" -}}
{{- else if eq .Values.model.source "repository" -}}
{{- $_ := unset $config "MHA_MODEL_DIR" -}}
{{- $_ := set $config "MHA_MODEL_REPOSITORY" "/models" -}}
{{- $_ := set $config "MHA_MODEL_CONTROL_MODE" "poll" -}}
{{- $_ := set $config "MHA_REPOSITORY_POLL_SECS" (toString .Values.model.pollSecs) -}}
{{- end -}}
{{- $routing := .Values.routing -}}
{{- if or (eq .Values.autoscaling.mode "keda") $routing.gatewayApi.enabled $routing.istio.enabled $routing.ingressNginx.enabled -}}
{{- /* an L7 balancer or KEDA spreads sequences over replicas: a step must say its offset */ -}}
{{- $_ := set $config "MHA_REQUIRE_SEQUENCE_OFFSET" (get $config "MHA_REQUIRE_SEQUENCE_OFFSET" | default "true") -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}


{{- define "mha-serve.exportContainer" -}}
- name: export
  image: {{ include "mha-serve.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: {{ concat (list "mha" "export" "--checkpoint" (printf "/checkpoints/%s" .Values.model.checkpoint) "--out" "/models/custom" "--force") .Values.model.exportArgs | toJson }}
  env:
    - {name: HOME, value: /tmp}
  securityContext:
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: true
    capabilities: {drop: [ALL]}
  resources:
    requests: {cpu: "1", memory: 1Gi}
    limits: {cpu: "2", memory: 2Gi}
  volumeMounts:
    - {name: checkpoints, mountPath: /checkpoints, readOnly: true}
    - {name: models, mountPath: /models}
    - {name: tmp, mountPath: /tmp}
{{- end -}}

{{- define "mha-serve.modelVolumes" -}}
{{- if eq .Values.model.source "checkpoint" }}
- name: checkpoints
  persistentVolumeClaim: {claimName: {{ include "mha-serve.claimName" . }}, readOnly: true}
- name: models
  emptyDir: {}
{{- else if eq .Values.model.source "repository" }}
- name: model-repository
  persistentVolumeClaim: {claimName: {{ include "mha-serve.claimName" . }}, readOnly: true}
{{- end }}
{{- end -}}

{{- define "mha-serve.modelMounts" -}}
{{- if eq .Values.model.source "checkpoint" }}
- {name: models, mountPath: /models, readOnly: true}
{{- else if eq .Values.model.source "repository" }}
- {name: model-repository, mountPath: /models, readOnly: true}
{{- end }}
{{- end -}}

{{- define "mha-serve.podCostContainer" -}}
- name: pod-cost
  image: {{ include "mha-serve.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args: ["mha", "pod-cost", "--metrics-url", "127.0.0.1:{{ .Values.config.MHA_METRICS_PORT }}", "--interval-s", {{ .Values.podDeletionCost.intervalSeconds | quote }}]
  env:
    - name: MHA_POD_NAME
      valueFrom: {fieldRef: {fieldPath: metadata.name}}
    - {name: HOME, value: /tmp}
  resources:
    requests: {cpu: 10m, memory: 64Mi}
    limits: {cpu: 100m, memory: 128Mi}
  securityContext:
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: true
    runAsNonRoot: true
    capabilities: {drop: [ALL]}
  volumeMounts:
    - {name: pod-cost-token, mountPath: /var/run/secrets/kubernetes.io/serviceaccount, readOnly: true}
{{- end -}}

{{- /* the tokens' Secrets as one read-only folder: the server's both, the test pod's only the token (`admin`: false) */ -}}
{{- define "mha-serve.tokenVolume" -}}
{{- $admin := and .admin .Values.auth.adminTokenSecret -}}
{{- if or .Values.auth.tokenSecret $admin }}
- name: tokens
  projected:
    sources:
      {{- with .Values.auth.tokenSecret }}
      - secret: {name: {{ . }}, items: [{key: token, path: token}]}
      {{- end }}
      {{- if $admin }}
      - secret: {name: {{ .Values.auth.adminTokenSecret }}, items: [{key: token, path: admin-token}]}
      {{- end }}
{{- end }}
{{- end -}}

{{- define "mha-serve.tokenMount" -}}
{{- if or .Values.auth.tokenSecret (and .admin .Values.auth.adminTokenSecret) }}
- {name: tokens, mountPath: /etc/mha-serve/tokens, readOnly: true}
{{- end }}
{{- end -}}

{{- /* the kubelet's gRPC probes speak plaintext: under TLS they go to the health port alone */ -}}
{{- define "mha-serve.probePort" -}}
{{- ternary 8003 8001 (not (empty .Values.tls.secret)) -}}
{{- end -}}

{{- define "mha-serve.grpcAppProtocol" -}}
{{- if not .Values.tls.secret }}, appProtocol: kubernetes.io/h2c{{ end -}}
{{- end -}}
