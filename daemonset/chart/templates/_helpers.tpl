{{/* The chart's name: nameOverride, else the chart's. */}}
{{- define "vgpu.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The objects' name: fullnameOverride; else the release's name when it holds the chart's
name (helm install vgpu-device-plugin ...), else <release>-<name>. Two releases in one namespace
get objects of their own. With fullnameOverride=vgpu-device-plugin the objects are named as the
kustomize install names them. */}}
{{- define "vgpu.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "vgpu.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels of every object. */}}
{{- define "vgpu.labels" -}}
{{ include "vgpu.selectorLabels" . }}
app.kubernetes.io/part-of: vgpu
{{- end -}}

{{/* What selects this release's daemon pods, and only them. */}}
{{- define "vgpu.selectorLabels" -}}
app.kubernetes.io/name: {{ include "vgpu.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "vgpu.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{/* The driver root on the host: hostPaths.driverRoot, or NVIDIA's nvidiaDriverRoot ("/", the
host's own, is where the NVIDIA runtime finds it: nothing to mount). */}}
{{- define "vgpu.driverRoot" -}}
{{- $nvidia := .Values.nvidiaDriverRoot | default "" -}}
{{- .Values.hostPaths.driverRoot | default (ternary "" $nvidia (eq $nvidia "/")) -}}
{{- end -}}

{{/* The name of a cluster-wide object of this release (ClusterRole, ClusterRoleBinding,
ValidatingAdmissionPolicy and its binding): the release's namespace and the objects' name, so
that releases in two namespaces, or two releases in one, each have their own. */}}
{{- define "vgpu.clusterName" -}}
{{- printf "%s-%s" .Release.Namespace (include "vgpu.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The user the API server sees for the daemon's service account token. */}}
{{- define "vgpu.serviceAccountUser" -}}
system:serviceaccount:{{ .Release.Namespace }}:{{ include "vgpu.fullname" . }}
{{- end -}}

{{/* Refuse values that contradict each other, or that this chart does not have, with what to do;
and config files the daemon would refuse or could not run with (_config.tpl). */}}
{{- define "vgpu.validate" -}}
{{- include "vgpu.refuseNvidiaValues" . -}}
{{- $config := include "vgpu.config" . | fromJson -}}
{{- $inline := omit $config "name" "map" "default" "fallbackStrategies" -}}
{{- if and $config.name $config.map -}}
{{- fail "config.name (an existing ConfigMap) and config.map (named configs the chart creates) exclude each other: set one" -}}
{{- end -}}
{{- if and $inline (include "vgpu.perNode" .) -}}
{{- fail (printf "config holds an inline config (%s) and config.name or config.map: put the inline config into config.map as a named config instead" (keys $inline | sortAlpha | join ", ")) -}}
{{- end -}}
{{- if and $config.default (not (include "vgpu.perNode" .)) -}}
{{- fail "config.default names one of several named configs: it needs config.map or config.name" -}}
{{- end -}}
{{- if hasKey .Values "migStrategy" -}}
{{- fail "migStrategy is a setting of the config file in vgpu: set config.mig.strategy (vgpu's format) or config.flags.migStrategy (NVIDIA's), or put it into each config of config.map" -}}
{{- end -}}
{{- if hasKey .Values "deviceListStrategy" -}}
{{- fail "deviceListStrategy is a setting of the config file in vgpu: set config.allocation.deviceListStrategy (vgpu's format) or config.flags.plugin.deviceListStrategy (NVIDIA's)" -}}
{{- end -}}
{{- if and .Values.nvidiaDriverRoot .Values.hostPaths.driverRoot (ne .Values.nvidiaDriverRoot "/") (ne .Values.nvidiaDriverRoot .Values.hostPaths.driverRoot) -}}
{{- fail "nvidiaDriverRoot (NVIDIA's name) and hostPaths.driverRoot differ: set one" -}}
{{- end -}}
{{- if and .Values.dra.enabled (eq (.Values.deviceIDStrategy | default "uuid") "index") -}}
{{- fail "deviceIDStrategy: index names GPUs to the runtime for the device plugins; the DRA driver (dra.enabled) always names them by UUID, as NVIDIA's DRA driver does: leave deviceIDStrategy unset" -}}
{{- end -}}
{{- if and $config.map $config.default -}}
{{- if not (hasKey $config.map $config.default) -}}
{{- fail (printf "config.default is %q, which config.map does not hold (it holds: %s)" $config.default (keys $config.map | sortAlpha | join ", ")) -}}
{{- end -}}
{{- end -}}
{{- include "vgpu.validateConfigs" . -}}
{{- end -}}
