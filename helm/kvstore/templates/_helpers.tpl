{{- define "kvstore.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}{{ .Release.Name | trunc 53 | trimSuffix "-" }}{{- else -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 53 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "kvstore.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvstore.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvstore.secretName" -}}{{ include "kvstore.fullname" . }}{{- end -}}

{{- define "kvstore.redisURL" -}}
{{- if .Values.index.valkey.enabled -}}
redis://{{ include "kvstore.fullname" . }}-valkey:{{ .Values.index.valkey.port }}/0
{{- else -}}
{{- required "index.external.url is required when index.valkey.enabled is false" .Values.index.external.url -}}
{{- end -}}
{{- end -}}

{{- define "kvstore.passwordSecret" -}}{{ default (include "kvstore.secretName" .) .Values.index.existingSecret }}{{- end -}}
{{- define "kvstore.tokenSecret" -}}{{ default (include "kvstore.secretName" .) .Values.auth.existingSecret }}{{- end -}}

{{/* Bytes in a Kubernetes quantity such as 16Gi, 512Mi or 8G. */}}
{{- define "kvstore.bytes" -}}
{{- $q := toString . -}}
{{- $units := dict "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 -}}
{{- $num := regexFind "^[0-9.]+" $q -}}
{{- $unit := trimPrefix $num $q -}}
{{- if not $num -}}{{- fail (printf "cannot read memory quantity %q" $q) -}}{{- end -}}
{{- if $unit -}}
{{- if not (hasKey $units $unit) -}}{{- fail (printf "unsupported unit in memory quantity %q" $q) -}}{{- end -}}
{{- mulf (float64 $num) (get $units $unit) | int64 -}}
{{- else -}}
{{- float64 $num | int64 -}}
{{- end -}}
{{- end -}}

{{/* Page memory per node: explicit storage.capacity, else a fraction of the memory limit. */}}
{{- define "kvstore.capacity" -}}
{{- if .Values.storage.capacity -}}
{{- .Values.storage.capacity -}}
{{- else -}}
{{- $limit := required "storage.resources.limits.memory is required when storage.capacity is empty" (dig "limits" "memory" "" .Values.storage.resources) -}}
{{- mulf (include "kvstore.bytes" $limit | float64) .Values.storage.capacityFraction | int64 -}}
{{- end -}}
{{- end -}}

{{- define "kvstore.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}{{ default (include "kvstore.fullname" .) .Values.serviceAccount.name }}{{- else -}}{{ default "default" .Values.serviceAccount.name }}{{- end -}}
{{- end -}}
