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

{{/* The storage nodes' index URL: as user kvstore-node when the chart makes the index users. */}}
{{- define "kvstore.nodeRedisURL" -}}
{{- if include "kvstore.indexUsers" . -}}
redis://kvstore-node@{{ include "kvstore.fullname" . }}-valkey:{{ .Values.index.valkey.port }}/0
{{- else -}}
{{ include "kvstore.redisURL" . }}
{{- end -}}
{{- end -}}

{{/* Non-empty when the chart creates index users (its own Valkey, index.acl.enabled). */}}
{{- define "kvstore.indexUsers" -}}{{ if and .Values.index.valkey.enabled .Values.index.acl.enabled }}true{{ end }}{{- end -}}

{{/* Redis ACL rules of an index role: (dict "role" "node"|"client"|"operator" "tenant" name).
     Mirrors kvstore/security/acl.py `rules` (tests/deploy/test_helm.py holds them equal). */}}
{{- define "kvstore.aclRules" -}}
{{- $common := "resetchannels -@all +ping +time +client|setinfo +cluster|slots +script|load +evalsha_ro +zrangebyscore +hgetall" -}}
{{- $lookup := "+evalsha +get +mget +set +pttl +pexpire" -}}
{{- if eq .role "node" -}}
resetkeys ~kvs:* {{ $common }} {{ $lookup }} +hsetnx +hget +hset +sadd +smembers +del +incr +zadd +zrem +zremrangebyscore +info
{{- else if eq .role "client" -}}
resetkeys ~kvs:t:{{ .tenant }}:* %R~kvs:{registry}:* {{ $common }} {{ $lookup }} +hsetnx
{{- else -}}
resetkeys %R~kvs:* {{ $common }} +smembers +hget
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

{{/* Bytes in a kvstore size such as 64GiB, 512MiB, 4G or 1000 (kvstore.settings.units.parse_size). */}}
{{- define "kvstore.sizeBytes" -}}
{{- $q := toString . | trim -}}
{{- $units := dict "" 1 "k" 1000 "m" 1000000 "g" 1000000000 "t" 1000000000000 "ki" 1024 "mi" 1048576 "gi" 1073741824 "ti" 1099511627776 -}}
{{- $num := regexFind "^[0-9.]+" $q -}}
{{- $unit := trimPrefix $num $q | trim | lower | trimSuffix "b" -}}
{{- if or (not $num) (not (hasKey $units $unit)) -}}{{- fail (printf "cannot read size %q: use a number with an optional unit such as 512MiB or 4GiB" $q) -}}{{- end -}}
{{- mulf (float64 $num) (get $units $unit) | int64 -}}
{{- end -}}

{{/* Page memory per node: explicit storage.capacity; else the hugepages amount when the
pool lives in hugepages (accounted apart from the memory limit); else a fraction of the
memory limit. */}}
{{- define "kvstore.capacity" -}}
{{- if .Values.storage.capacity -}}
{{- .Values.storage.capacity -}}
{{- else if .Values.rdma.hugepages.enabled -}}
{{- include "kvstore.bytes" .Values.rdma.hugepages.amount -}}
{{- else -}}
{{- $limit := required "storage.resources.limits.memory is required when storage.capacity is empty" (dig "limits" "memory" "" .Values.storage.resources) -}}
{{- mulf (include "kvstore.bytes" $limit | float64) .Values.storage.capacityFraction | int64 -}}
{{- end -}}
{{- end -}}

{{/* Values that cannot work fail here, at render time, naming what to change. */}}
{{- define "kvstore.validate" -}}
{{- $s := .Values.storage -}}
{{- $hp := .Values.rdma.hugepages -}}
{{- if ge ($s.lowWatermark | float64) ($s.highWatermark | float64) -}}
{{- fail (printf "storage.lowWatermark (%v) must be below storage.highWatermark (%v): eviction frees memory from the high mark down to the low one" $s.lowWatermark $s.highWatermark) -}}
{{- end -}}
{{- if lt ($s.nodeTTL | float64) (mulf 2 ($s.heartbeatInterval | float64)) -}}
{{- fail (printf "storage.nodeTTL (%v s) must be at least twice storage.heartbeatInterval (%v s), or one late heartbeat drops a live node" $s.nodeTTL $s.heartbeatInterval) -}}
{{- end -}}
{{- $capacity := include "kvstore.capacity" . | include "kvstore.sizeBytes" | int64 -}}
{{- $slab := include "kvstore.sizeBytes" $s.slabSize | int64 -}}
{{- if lt $capacity $slab -}}
{{- fail (printf "storage.capacity (%s) is below one slab (storage.slabSize %s): raise the capacity or lower the slab size" (include "kvstore.capacity" .) $s.slabSize) -}}
{{- end -}}
{{- if $s.disk.enabled -}}
{{- $disk := include "kvstore.sizeBytes" $s.disk.capacity | int64 -}}
{{- if lt $disk (add $slab 1048576 | int64) -}}
{{- fail (printf "storage.disk.capacity (%s) must hold one slab (storage.slabSize %s) and 1 MiB of metadata" $s.disk.capacity $s.slabSize) -}}
{{- end -}}
{{- if and (or (eq $s.kind "StatefulSet") (not $s.disk.volume)) $s.disk.size (gt $disk (include "kvstore.bytes" $s.disk.size | int64)) -}}
{{- fail (printf "storage.disk.capacity (%s) exceeds its volume (storage.disk.size %s): the disk would fill up before the tier evicts; lower the capacity or grow the volume" $s.disk.capacity $s.disk.size) -}}
{{- end -}}
{{- end -}}
{{- if $hp.enabled -}}
{{- $amount := include "kvstore.bytes" $hp.amount | int64 -}}
{{- if gt $capacity $amount -}}
{{- fail (printf "storage.capacity (%s) exceeds rdma.hugepages.amount (%s): the pool lives in hugepages, so request at least the capacity" (include "kvstore.capacity" .) $hp.amount) -}}
{{- end -}}
{{- $page := include "kvstore.bytes" $hp.pageSize | int64 -}}
{{- if ne (mod $slab $page) (0 | int64) -}}
{{- fail (printf "storage.slabSize (%s) must be a multiple of rdma.hugepages.pageSize (%s)" $s.slabSize $hp.pageSize) -}}
{{- end -}}
{{- else -}}
{{- $limit := dig "limits" "memory" "" $s.resources -}}
{{- if and $limit (gt $capacity (include "kvstore.bytes" $limit | int64)) -}}
{{- fail (printf "storage.capacity (%s) exceeds the memory limit (%s): the node would be OOM-killed; lower the capacity or raise storage.resources.limits.memory" (include "kvstore.capacity" .) $limit) -}}
{{- end -}}
{{- end -}}
{{- include "kvstore.validateEvents" . -}}
{{- end -}}

{{/* Non-empty when the KV event stream is authenticated: routers listed (inline or in a
Secret of the operator's). */}}
{{- define "kvstore.eventRouters" -}}
{{- with .Values.storage.kvEvents -}}{{ if and .enabled (or .routers .routersExistingSecret) }}true{{ end }}{{- end -}}
{{- end -}}

{{/* The routers file of storage.kvEvents.routers, as kvstore/security/routers.py reads it. */}}
{{- define "kvstore.eventRoutersFile" -}}
# name public-key (Z85) tenants: the routers that may subscribe (docs/security.md, "KV event stream")
{{- range .Values.storage.kvEvents.routers }}
{{ .name }} {{ .publicKey }} {{ join "," .tenants }}
{{- end }}
{{ end -}}

{{/* storage.kvEvents: the chart's nodes check tokens, so they refuse to start with an
unauthenticated stream on the pod's address (kvstore/settings/events.py). Router entries
get the checks of kvstore/security/routers.py `make_router_key` and `parse_router_keys`. */}}
{{- define "kvstore.validateEvents" -}}
{{- $e := .Values.storage.kvEvents -}}
{{- if $e.enabled -}}
{{- $tenantRE := `^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$` -}}
{{- $routed := or $e.routers $e.routersExistingSecret -}}
{{- if and $e.routers $e.routersExistingSecret -}}
{{- fail "storage.kvEvents: give the routers inline (routers) or in a Secret of yours (routersExistingSecret), not both" -}}
{{- end -}}
{{- if and $routed $e.open -}}
{{- fail "storage.kvEvents.open contradicts storage.kvEvents.routers: with routers the stream is authenticated and each router reads only its tenants; set open: false" -}}
{{- end -}}
{{- if not (or $routed $e.open) -}}
{{- fail (printf "storage.kvEvents.enabled: the storage nodes check tokens, so they would refuse to start: their KV events on tcp://*:%v would give every tenant's blocks to anyone who reaches the pod. List the routers allowed to subscribe in storage.kvEvents.routers (or routersExistingSecret) with the nodes' key in storage.kvEvents.keySecret, or set storage.kvEvents.open: true to publish to anyone anyway" $e.port) -}}
{{- end -}}
{{- if and $routed (not $e.keySecret) -}}
{{- fail "storage.kvEvents.keySecret is required with routers: the name of an existing Secret holding the nodes' CURVE secret key (a template cannot make one). Make it with `kvstore events-key node --out keys` (prints the public key routers pin) and `kubectl create secret generic kvstore-events-key --from-file=node.key_secret=keys/node.key_secret`, then set storage.kvEvents.keySecret: kvstore-events-key" -}}
{{- end -}}
{{- if and $e.keySecret (not $routed) -}}
{{- fail "storage.kvEvents.keySecret goes with storage.kvEvents.routers (or routersExistingSecret): the nodes' key authenticates them to routers listed there" -}}
{{- end -}}
{{- $names := dict -}}
{{- $keys := dict -}}
{{- range $i, $r := $e.routers -}}
{{- $what := printf "storage.kvEvents.routers[%d]" $i -}}
{{- $name := toString $r.name -}}
{{- if not (regexMatch `^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$` $name) -}}
{{- fail (printf "%s: router name %q must be 1-64 letters, digits or _.@-, starting with a letter or digit" $what $name) -}}
{{- end -}}
{{- $what = printf "storage.kvEvents.routers[%d] (%s)" $i $name -}}
{{- if not (regexMatch `^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$` (toString $r.publicKey)) -}}
{{- fail (printf "%s: publicKey must be 40 characters of Z85 text: the second field of the line `kvstore events-key router` printed (the public-key line of the router's .key file)" $what) -}}
{{- end -}}
{{- $tenants := $r.tenants | default list -}}
{{- if not $tenants -}}
{{- fail (printf "%s: name at least one tenant in tenants, or [\"*\"] for every tenant" $what) -}}
{{- end -}}
{{- if and (has "*" $tenants) (gt (len $tenants) 1) -}}
{{- fail (printf "%s: tenant * stands alone, not beside other tenants" $what) -}}
{{- end -}}
{{- range $tenants -}}
{{- if and (ne (toString .) "*") (not (regexMatch $tenantRE (toString .))) -}}
{{- fail (printf "%s: tenant %q must match %s" $what (toString .) $tenantRE) -}}
{{- end -}}
{{- end -}}
{{- if hasKey $names $name -}}
{{- fail (printf "%s: router %s is listed twice" $what $name) -}}
{{- end -}}
{{- if hasKey $keys (toString $r.publicKey) -}}
{{- fail (printf "%s: the key of %s is already listed as %s" $what $name (get $keys (toString $r.publicKey))) -}}
{{- end -}}
{{- $_ := set $names $name true -}}
{{- $_ := set $keys (toString $r.publicKey) $name -}}
{{- end -}}
{{- with $e.tokenIds -}}
{{- $ids := splitList "," (toString .) -}}
{{- if and (has "*" $ids) (gt (len $ids) 1) -}}
{{- fail (printf "storage.kvEvents.tokenIds %q: * stands alone, not beside other tenants" .) -}}
{{- end -}}
{{- range $ids -}}
{{- if and (ne . "*") (not (regexMatch $tenantRE .)) -}}
{{- fail (printf "storage.kvEvents.tokenIds: tenant %q must match %s (tenants comma-separated without spaces, or *)" . $tenantRE) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvstore.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}{{ default (include "kvstore.fullname" .) .Values.serviceAccount.name }}{{- else -}}{{ default "default" .Values.serviceAccount.name }}{{- end -}}
{{- end -}}
