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

{{- define "mha-serve.config" -}}
{{- $config := deepCopy .Values.config -}}
{{- if and .Values.gpu.enabled .Values.gpu.memoryLimitMb -}}
{{- $_ := set $config "MHA_GPU_MEM_LIMIT_MB" (toString .Values.gpu.memoryLimitMb) -}}
{{- end -}}
{{- $routing := .Values.routing -}}
{{- if or (eq .Values.autoscaling.mode "keda") $routing.gatewayApi.enabled $routing.istio.enabled $routing.ingressNginx.enabled -}}
{{- /* an L7 balancer or KEDA spreads sequences over replicas: a step must say its offset */ -}}
{{- $_ := set $config "MHA_REQUIRE_SEQUENCE_OFFSET" (get $config "MHA_REQUIRE_SEQUENCE_OFFSET" | default "true") -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}
