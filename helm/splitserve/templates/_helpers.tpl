{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "splitserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name. The RayService's name prefixes the names KubeRay derives from it
(RayCluster "<name>-<suffix>", Services "<name>-head-svc", "<name>-serve-svc"), so keep it short.
*/}}
{{- define "splitserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "splitserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "splitserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "splitserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "splitserve.labels" -}}
helm.sh/chart: {{ include "splitserve.chart" . }}
{{ include "splitserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "splitserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "splitserve.modelClaimName" -}}
{{- default (printf "%s-model" (include "splitserve.fullname" .)) .Values.model.pvc.existingClaim }}
{{- end }}

{{/* "true" when an init container must fetch the weights into the model volume. */}}
{{- define "splitserve.downloadsModel" -}}
{{- if or (eq .Values.model.source "download") (and (eq .Values.model.source "pvc") .Values.model.pvc.populate) }}true{{ end }}
{{- end }}

{{/*
Pods needed for a number of pool replicas: ceil(replicas / replicasPerPod).
Call with (list replicas replicasPerPod).
*/}}
{{- define "splitserve.podsFor" -}}
{{- $replicas := index . 0 | int }}
{{- $perPod := index . 1 | int }}
{{- div (add $replicas $perPod -1) $perPod }}
{{- end }}

{{/*
The worker groups: one per pool (prefill, decode) of serve; with serve.models, one per pool of
each model instead, named "<model slug>-<pool>", each with that model's merged pool settings
(splitserve.modelPool) and its pods' settings from modelWorkerGroups.<served name>.<pool> over
workerGroups.<pool>. A model pool with no replicas at all (replicas 0, not autoscaling) gets
no group.
*/}}
{{- define "splitserve.workerGroups" -}}
{{- $root := . }}
{{- $serve := .Values.serve }}
{{- if $serve.models }}
{{- $seen := dict }}
{{- range $entry := $serve.models }}
{{- $topId := $serve.served_model_name | default $serve.model | default "" }}
{{- $served := $entry.served_model_name | default $entry.model | default $topId | toString }}
{{- $slug := include "splitserve.modelSlug" $served }}
{{- if hasKey $seen $slug }}
{{- fail (printf "serve.models: two models are served as %q; give each a distinct served_model_name" $served) }}
{{- end }}
{{- $_ := set $seen $slug $served }}
{{- $podValues := index ($root.Values.modelWorkerGroups | default dict) $served | default dict }}
{{- range $poolName := list "prefill" "decode" }}
{{- $pool := include "splitserve.modelPool" (dict "base" (index $serve $poolName) "over" (index $entry $poolName)) | fromJson }}
{{- $group := deepCopy (index $root.Values.workerGroups $poolName) }}
{{- range $key, $value := (index $podValues $poolName | default dict) }}
{{- $_ := set $group $key $value }}
{{- end }}
{{- $autoscaling := $pool.autoscaling | default dict }}
{{- if or $autoscaling.enabled (gt ($pool.replicas | int) 0) }}
{{ include "splitserve.workerGroup" (dict "root" $root "poolName" $poolName "pool" $pool "group" $group "groupName" (printf "%s-%s" $slug $poolName) "model" $slug) | trim }}
{{- end }}
{{- end }}
{{- end }}
{{- $served := values $seen }}
{{- range $key := keys ($root.Values.modelWorkerGroups | default dict) | sortAlpha }}
{{- if not (has $key $served) }}
{{- fail (printf "modelWorkerGroups.%s: no model in serve.models is served as %q (served: %s)" $key $key (join ", " (sortAlpha $served))) }}
{{- end }}
{{- end }}
{{- else }}
{{- if $root.Values.modelWorkerGroups }}
{{- fail "modelWorkerGroups is set but serve.models is empty: set workerGroups instead" }}
{{- end }}
{{- range $poolName := list "prefill" "decode" }}
{{ include "splitserve.workerGroup" (dict "root" $root "poolName" $poolName "pool" (index $serve $poolName) "group" (index $root.Values.workerGroups $poolName) "groupName" $poolName) | trim }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A served name as a DNS label of at most 48 characters (room for "-prefill"): lowercase
[a-z0-9-]; a name that does not fit as is gets 7 hex digits of its sha256, so two served names
never share a slug.
*/}}
{{- define "splitserve.modelSlug" -}}
{{- $name := . | toString }}
{{- $slug := regexReplaceAll "[^a-z0-9-]+" (lower $name) "-" | trimAll "-" }}
{{- if or (ne $slug $name) (gt (len $slug) 48) }}
{{- $slug = printf "%s-%s" ($slug | trunc 40 | trimSuffix "-") (sha256sum $name | trunc 7) | trimPrefix "-" }}
{{- end }}
{{- $slug }}
{{- end }}

{{/*
One model's pool settings, as JSON: serve.<pool> with the model entry's <pool> over it, the way
ServeConfig.model_deployments() merges them (model_entry_config.deep_merge): each key the entry
gives replaces the top level's, except resources and autoscaling, merged key by key; the custom
resources dict (resources.resources) is replaced whole; a null is not given. Sprig's
mergeOverwrite would merge that dict too (a model would keep the top level's custom resources
beside its own and land on either's nodes), hence the explicit loops.
Call with (dict "base" serve.<pool> "over" entry.<pool>).
*/}}
{{- define "splitserve.modelPool" -}}
{{- $merged := deepCopy (.base | default dict) }}
{{- range $key, $value := (.over | default dict) }}
{{- $current := index $merged $key }}
{{- if kindIs "invalid" $value }}
{{- else if and (has $key (list "resources" "autoscaling")) (kindIs "map" $value) (kindIs "map" $current) }}
{{- $inner := deepCopy $current }}
{{- range $k, $v := $value }}
{{- if not (kindIs "invalid" $v) }}
{{- $_ := set $inner $k $v }}
{{- end }}
{{- end }}
{{- $_ := set $merged $key $inner }}
{{- else }}
{{- $_ := set $merged $key $value }}
{{- end }}
{{- end }}
{{- toJson $merged }}
{{- end }}

{{/*
Worker group spec fields of one pool: pool (its serve settings), poolName, group (its
workerGroups settings), groupName, and model (the model's slug, with serve.models).
*/}}
{{- define "splitserve.workerGroup" -}}
{{- $root := .root }}
{{- $poolName := .poolName }}
{{- $pool := .pool }}
{{- $group := .group }}
{{- $perPod := $group.replicasPerPod | int }}
{{- $autoscaling := $pool.autoscaling | default dict }}
{{- $replicas := 1 }}
{{- if hasKey $pool "replicas" }}
{{- $replicas = $pool.replicas | int }}
{{- end }}
{{- $minReplicas := $replicas }}
{{- $maxReplicas := $replicas }}
{{- if $autoscaling.enabled }}
{{- $minReplicas = (hasKey $autoscaling "min_replicas" | ternary $autoscaling.min_replicas 1) | int }}
{{- $maxReplicas = $autoscaling.max_replicas | default 1 | int }}
{{- if gt $minReplicas $maxReplicas }}
{{- fail (printf "%s: autoscaling.min_replicas (%d) must be <= max_replicas (%d)" .groupName $minReplicas $maxReplicas) }}
{{- end }}
{{- end }}
{{- $minPods := include "splitserve.podsFor" (list $minReplicas $perPod) | int }}
{{- $maxPods := include "splitserve.podsFor" (list $maxReplicas $perPod) | int }}
{{- $poolResources := $pool.resources | default dict }}
{{- /* A replica is tensor_parallel_size ranks, each asking for the pool's resources on the same
node (one STRICT_PACK placement group), so a pod hosting replicasPerPod replicas holds
tensor_parallel_size x replicasPerPod of them. */}}
{{- $ranksPerPod := mul ($pool.tensor_parallel_size | default 1 | int) $perPod }}
{{- $numGpus := ceil (mulf ($poolResources.num_gpus | default 0) $ranksPerPod) | int }}
{{- $custom := dict }}
{{- range $key, $amount := ($poolResources.resources | default dict) }}
{{- $_ := set $custom $key (mulf $amount $ranksPerPod) }}
{{- end }}
{{- $rayStartParams := dict }}
{{- if $custom }}
{{- $_ := set $rayStartParams "resources" (toJson $custom | quote) }}
{{- end }}
{{- /* The derived resources win over a user-given rayStartParams.resources. */}}
{{- $rayStartParams = merge $rayStartParams (deepCopy ($group.rayStartParams | default dict)) }}
- groupName: {{ .groupName }}
  {{- if $root.Values.rayAutoscaler.enabled }}
  replicas: {{ $minPods }}
  minReplicas: {{ $minPods }}
  maxReplicas: {{ $maxPods }}
  {{- else }}
  replicas: {{ $maxPods }}
  minReplicas: {{ $maxPods }}
  maxReplicas: {{ $maxPods }}
  {{- end }}
  rayStartParams:
    {{- range $key, $value := $rayStartParams }}
    {{ $key }}: {{ $value | toString | quote }}
    {{- end }}
    {{- if not $rayStartParams }} {}{{ end }}
  template:
    metadata:
      labels:
        {{- include "splitserve.selectorLabels" $root | nindent 8 }}
        app.kubernetes.io/component: {{ $poolName }}
        {{- with .model }}
        splitserve.io/model: {{ . }}
        {{- end }}
      {{- with $group.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with include "splitserve.modelInitContainers" $root }}{{ . | trim | nindent 6 }}{{ end }}
      {{- /* Pod deletion drains the node's replicas first (their streams move to other
      replicas): the preStop hook SIGTERMs each replica process, which asks the controller for
      a drain (runtime/sigterm_drain.py), and waits until they are gone; the grace period
      covers the drain's 120 s timeout. */}}
      terminationGracePeriodSeconds: 180
      containers:
        - name: ray-worker
          image: {{ include "splitserve.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          lifecycle:
            preStop:
              exec:
                command: ["splitserve", "drain-node", "--timeout-s", "170"]
          env:
            {{- include "splitserve.frontDoorEnv" $root | nindent 12 }}
            {{- with $group.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          resources:
            {{- $resources := deepCopy ($group.resources | default dict) }}
            {{- if gt $numGpus 0 }}
            {{- $limits := $resources.limits | default dict }}
            {{- $_ := set $limits "nvidia.com/gpu" $numGpus }}
            {{- $_ := set $resources "limits" $limits }}
            {{- end }}
            {{- toYaml $resources | nindent 12 }}
          volumeMounts:
            - name: dshm
              mountPath: /dev/shm
            {{- with include "splitserve.modelVolumeMount" $root }}{{ . | trim | nindent 12 }}{{ end }}
            {{- with include "splitserve.stateVolumeMount" $root }}{{ . | trim | nindent 12 }}{{ end }}
      volumes:
        - name: dshm
          emptyDir:
            medium: Memory
            {{- with $group.shmSize }}
            sizeLimit: {{ . }}
            {{- end }}
        {{- with include "splitserve.modelVolume" $root }}{{ . | trim | nindent 8 }}{{ end }}
        {{- with include "splitserve.stateVolume" $root }}{{ . | trim | nindent 8 }}{{ end }}
      {{- with $group.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $group.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $group.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end }}

{{/* The model volume of a Ray pod (nothing when the image holds the model). */}}
{{- define "splitserve.modelVolume" -}}
{{- $source := .Values.model.source }}
{{- if eq $source "download" }}
- name: model
  emptyDir:
    {{- with .Values.model.download.sizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
{{- else if eq $source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ include "splitserve.modelClaimName" . }}
{{- else if eq $source "hostPath" }}
- name: model
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    {{- with .Values.model.hostPath.type }}
    type: {{ . }}
    {{- end }}
{{- end }}
{{- end }}

{{- define "splitserve.stateClaimName" -}}
{{- default (printf "%s-state" (include "splitserve.fullname" .)) .Values.state.pvc.existingClaim }}
{{- end }}

{{/* The state store's volume of a Ray pod (none when serve.state_url names a database), and
the tenants' keys Secret when tenantKeys.secretName is set. */}}
{{- define "splitserve.stateVolume" -}}
{{- if not .Values.serve.state_url }}
- name: state
  persistentVolumeClaim:
    claimName: {{ include "splitserve.stateClaimName" . }}
{{- end }}
{{- if .Values.tenantKeys.secretName }}
- name: tenant-keys
  secret:
    secretName: {{ .Values.tenantKeys.secretName }}
{{- end }}
{{- end }}

{{/* Mounts the state volume at serve.state_dir, read-write (SQLite in WAL mode writes there). */}}
{{- define "splitserve.stateVolumeMount" -}}
{{- if not .Values.serve.state_url }}
- name: state
  mountPath: {{ .Values.serve.state_dir }}
{{- end }}
{{- if .Values.tenantKeys.secretName }}
- name: tenant-keys
  mountPath: {{ .Values.tenantKeys.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* Mounts <volume>/<subPath> at serve.model, read-only: replicas only load weights. */}}
{{- define "splitserve.modelVolumeMount" -}}
{{- if ne .Values.model.source "image" }}
- name: model
  mountPath: {{ .Values.serve.model }}
  subPath: {{ .Values.model.subPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/*
Init container that downloads the weights into <volume>/<subPath> unless config.json is
already there. It downloads beside the target and renames, so pods sharing a PVC never see a
half-written model.
*/}}
{{- define "splitserve.modelInitContainers" -}}
{{- if include "splitserve.downloadsModel" . }}
{{- $download := .Values.model.download }}
initContainers:
  - name: model-download
    image: {{ include "splitserve.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command:
      - /bin/bash
      - -ec
      - |
        target="/model-volume/$MODEL_SUBPATH"
        if [ -f "$target/config.json" ]; then
          echo "model already in $target"
          exit 0
        fi
        partial="$target.partial-$HOSTNAME"
        rm -rf "$partial"
        mkdir -p "$(dirname "$target")"
        python -c 'import sys; from huggingface_hub import snapshot_download; snapshot_download(sys.argv[1], revision=sys.argv[2], local_dir=sys.argv[3])' "$MODEL_REPO_ID" "$MODEL_REVISION" "$partial"
        mv -T "$partial" "$target" || rm -rf "$partial"
        test -f "$target/config.json"
    env:
      - name: MODEL_REPO_ID
        value: {{ $download.repoId | quote }}
      - name: MODEL_REVISION
        value: {{ $download.revision | quote }}
      - name: MODEL_SUBPATH
        value: {{ .Values.model.subPath | quote }}
      {{- if $download.tokenSecret.name }}
      - name: HF_TOKEN
        valueFrom:
          secretKeyRef:
            name: {{ $download.tokenSecret.name }}
            key: {{ $download.tokenSecret.key }}
      {{- end }}
    volumeMounts:
      - name: model
        mountPath: /model-volume
{{- end }}
{{- end }}

{{/* Checks across values that values.schema.json cannot express. */}}
{{- define "splitserve.validate" -}}
{{- if and (ne .Values.model.source "image") (not .Values.serve.model) }}
{{- fail (printf "model.source %q mounts the weights at serve.model, so serve.model must be set" .Values.model.source) }}
{{- end }}
{{- if and .Values.serve.model (ne .Values.model.source "image") (not (hasPrefix "/" .Values.serve.model)) }}
{{- fail (printf "serve.model must be an absolute path inside the pods, got %q" .Values.serve.model) }}
{{- end }}
{{- if and (not .Values.serve.state_url) (not (hasPrefix "/" (.Values.serve.state_dir | default ""))) }}
{{- fail (printf "serve.state_dir must be an absolute path inside the pods (the state volume's mount), or set serve.state_url; got %q" (.Values.serve.state_dir | default "")) }}
{{- end }}
{{- if eq .Values.serve.http_port .Values.serve.grpc_port }}
{{- fail "serve.http_port and serve.grpc_port must differ" }}
{{- end }}
{{- if eq (.Values.serve.http_listener | default "auto") "ingress" }}
{{- fail "serve.http_listener: ingress is for `splitserve serve` on one machine; the chart serves HTTP through Ray's HAProxy (auto or haproxy)" }}
{{- end }}
{{- end }}

{{/*
The front door's environment (values.frontDoor), the same on the head and every worker group.
*/}}
{{- define "splitserve.frontDoorEnv" -}}
{{- $fd := .Values.frontDoor | default dict }}
{{- if $fd.haproxy }}
- name: RAY_SERVE_ENABLE_HA_PROXY
  value: "1"
- name: RAY_SERVE_THROUGHPUT_OPTIMIZED
  value: "1"
- name: RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S
  value: {{ $fd.drainingPeriodS | default 30 | toString | quote }}
- name: RAY_SERVE_HAPROXY_NBTHREAD
  value: {{ $fd.haproxyThreads | default 4 | toString | quote }}
- name: RAY_SERVE_HAPROXY_MAXCONN
  value: {{ .Values.serve.http_max_connections | default 4096 | toString | quote }}
- name: RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S
  value: {{ .Values.serve.http_request_timeout_s | default 30 | ceil | int | toString | quote }}
- name: RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S
  value: {{ $fd.proxyCheckTimeoutS | default 30 | toString | quote }}
- name: RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S
  value: {{ $fd.proxyCheckTimeoutS | default 30 | toString | quote }}
{{- else }}
- name: RAY_SERVE_ENABLE_HA_PROXY
  value: "0"
{{- end }}
{{- end }}
