{{/* The daemon's config files: `config` as the chart reads it, and their checks at render.

`config` is one of: a map holding an inline config file (vgpu's keys or NVIDIA's) and/or NVIDIA's
chart knobs (map, name, default, fallbackStrategies); or a string, the file itself, as
`--set-file config=FILE` gives it. */}}

{{/* `config`'s knobs and inline keys as a map (JSON): a file given as a string has no knobs. */}}
{{- define "vgpu.config" -}}
{{- if kindIs "string" .Values.config -}}
{{- dict | toJson -}}
{{- else -}}
{{- .Values.config | default dict | toJson -}}
{{- end -}}
{{- end -}}

{{/* The inline config file's text: the string given, or the inline keys as YAML. */}}
{{- define "vgpu.inlineConfig" -}}
{{- if kindIs "string" .Values.config -}}
{{- .Values.config -}}
{{- else -}}
{{- omit (.Values.config | default dict) "name" "map" "default" "fallbackStrategies" | toYaml -}}
{{- end -}}
{{- end -}}

{{/* "true" when the configs are named and chosen per node (config.map or config.name). */}}
{{- define "vgpu.perNode" -}}
{{- $config := include "vgpu.config" . | fromJson -}}
{{- if or $config.name $config.map -}}true{{- end -}}
{{- end -}}

{{/* The ConfigMap the daemon reads: config.name, else the chart's own. */}}
{{- define "vgpu.configMapName" -}}
{{- $config := include "vgpu.config" . | fromJson -}}
{{- $config.name | default (printf "%s-config" (include "vgpu.fullname" .)) -}}
{{- end -}}

{{/* Every config file the chart writes, read as YAML, as JSON: {"<value>": <the file's keys>}
where <value> names where it came from (config, config.map.NAME). A file that is not a YAML
mapping is {"Error": <why>}, as fromYaml has it. config.name's files are not the chart's to
read: the daemon checks them. */}}
{{- define "vgpu.parsedConfigs" -}}
{{- $out := dict -}}
{{- $config := include "vgpu.config" . | fromJson -}}
{{- $inline := omit $config "name" "map" "default" "fallbackStrategies" -}}
{{- if kindIs "string" .Values.config -}}
{{- $_ := set $out "config" (fromYaml .Values.config) -}}
{{- else if $inline -}}
{{- $_ := set $out "config" $inline -}}
{{- end -}}
{{- range $name, $content := $config.map | default dict -}}
{{- if kindIs "string" $content -}}
{{- $_ := set $out (printf "config.map.%s" $name) (fromYaml $content) -}}
{{- else -}}
{{- $_ := set $out (printf "config.map.%s" $name) ($content | default dict) -}}
{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* What the chart must know of one parsed config file (JSON): its format, whether it turns
MPS on and with which root, its DRA driver. Keys of NVIDIA's format are matched ignoring case,
as NVIDIA's plugin (and vgpu, reading such a file) matches them. */}}
{{- define "vgpu.configFacts" -}}
{{- $nvidia := list -}}
{{- $vgpu := list -}}
{{- $mps := false -}}
{{- $root := "" -}}
{{- $driver := "" -}}
{{- range $key, $value := . -}}
{{- $lower := lower $key -}}
{{- if has $lower (list "flags" "resources" "sharing" "imex") -}}
{{- $nvidia = append $nvidia $key -}}
{{- end -}}
{{- if has $key (list "resourceName" "slicing" "allocation" "enforcement" "mps" "nodeLabels" "mig" "dra") -}}
{{- $vgpu = append $vgpu $key -}}
{{- end -}}
{{- if and (eq $lower "sharing") (kindIs "map" $value) -}}
{{- range $inner, $section := $value -}}
{{- if and (eq (lower $inner) "mps") (not (kindIs "invalid" $section)) -}}
{{- $mps = true -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and (eq $lower "flags") (kindIs "map" $value) -}}
{{- range $inner, $flag := $value -}}
{{- if and (eq (lower $inner) "mpsroot") (kindIs "string" $flag) -}}
{{- $root = $flag -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if not $nvidia -}}
{{- $section := get . "mps" -}}
{{- if kindIs "map" $section -}}
{{- $mps = eq (toString (get $section "enabled")) "true" -}}
{{- $root = get $section "root" | default "" | toString -}}
{{- end -}}
{{- $dra := get . "dra" -}}
{{- if kindIs "map" $dra -}}
{{- $driver = get $dra "driverName" | default "" | toString -}}
{{- end -}}
{{- end -}}
{{- dict "nvidia" $nvidia "vgpu" $vgpu "mps" $mps "root" $root "driver" $driver | toJson -}}
{{- end -}}

{{/* The DRA driver every config names (dra.driverName; vgpu.dev by default): the chart's
plugin directory and DeviceClasses are its. Configs that name different ones are refused by
vgpu.validate. */}}
{{- define "vgpu.draDriver" -}}
{{- $drivers := list -}}
{{- range $where, $parsed := include "vgpu.parsedConfigs" . | fromJson -}}
{{- $facts := include "vgpu.configFacts" $parsed | fromJson -}}
{{- $drivers = append $drivers ($facts.driver | default "vgpu.dev") -}}
{{- end -}}
{{- $drivers | default (list "vgpu.dev") | uniq | sortAlpha | join ", " -}}
{{- end -}}

{{/* Refuse config files the daemon would refuse or could not run with this chart's pod, saying
which value and what to do. */}}
{{- define "vgpu.validateConfigs" -}}
{{- $chartMps := .Values.mps -}}
{{- range $where, $parsed := include "vgpu.parsedConfigs" . | fromJson -}}
{{- if hasKey $parsed "Error" -}}
{{- fail (printf "%s is not a YAML mapping of config keys (%s): give the config file's content, vgpu's format or NVIDIA's" $where (get $parsed "Error")) -}}
{{- end -}}
{{- $facts := include "vgpu.configFacts" $parsed | fromJson -}}
{{- if and $facts.nvidia $facts.vgpu -}}
{{- fail (printf "%s mixes NVIDIA's format (%s) with vgpu's keys (%s), which the daemon refuses: write it in one format (docs/migrating.md)" $where (join ", " $facts.nvidia) (join ", " $facts.vgpu)) -}}
{{- end -}}
{{- if $facts.mps -}}
{{- $how := ternary "sharing.mps" "mps.enabled" (not (empty $facts.nvidia)) -}}
{{- if not $chartMps.enabled -}}
{{- fail (printf "%s turns MPS on (%s): set mps.enabled=true too, for what the daemon needs for it (the MPS root from the host, CAP_SETUID and CAP_SETGID)" $where $how) -}}
{{- end -}}
{{- $rootKey := ternary "flags.mpsRoot" "mps.root" (not (empty $facts.nvidia)) -}}
{{- $root := $facts.root | default "/run/vgpu/mps" -}}
{{- if ne $root $chartMps.root -}}
{{- $said := ternary (printf "%s is %s" $rootKey $root) (printf "%s is not set, so the daemon uses %s" $rootKey $root) (not (empty $facts.root)) -}}
{{- fail (printf "%s: %s, but mps.root (the host directory the chart mounts) is %s: make them the same" $where $said $chartMps.root) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if .Values.dra.enabled -}}
{{- $driver := include "vgpu.draDriver" . -}}
{{- if contains ", " $driver -}}
{{- fail (printf "the configs name different DRA drivers (dra.driverName: %s): the chart mounts one driver's plugin directory and makes its DeviceClasses; give every config the same" $driver) -}}
{{- end -}}
{{- end -}}
{{- end -}}
