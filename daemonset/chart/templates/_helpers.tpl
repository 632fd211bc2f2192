{{/* The objects' name: the chart's, as in daemonset/base. */}}
{{- define "vgpu.name" -}}
vgpu-device-plugin
{{- end -}}

{{/* Labels of every object. */}}
{{- define "vgpu.labels" -}}
app.kubernetes.io/name: {{ include "vgpu.name" . }}
app.kubernetes.io/part-of: vgpu
{{- end -}}

{{- define "vgpu.selectorLabels" -}}
app.kubernetes.io/name: {{ include "vgpu.name" . }}
{{- end -}}

{{- define "vgpu.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{/* The config file: .Values.config with nodeLabels.file, mps.enabled and mps.root from their
values. */}}
{{- define "vgpu.config" -}}
{{- $config := deepCopy (.Values.config | default dict) -}}
{{- if .Values.nodeLabels.enabled -}}
{{- $_ := set $config "nodeLabels" (dict "file" "vgpu") -}}
{{- end -}}
{{- if .Values.mps.enabled -}}
{{- $mps := deepCopy (get $config "mps" | default dict) -}}
{{- $_ := set $mps "enabled" true -}}
{{- $_ := set $mps "root" .Values.mps.root -}}
{{- $_ := set $config "mps" $mps -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}
