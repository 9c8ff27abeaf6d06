"""The Redis registry's server-side scripts (Lua), each one atomic round trip (EVALSHA).

Key layout and stream fields: see registry/redis_registry.py's docstring and wire.py.
"""

REGISTER = """
local e = redis.call('INCR', KEYS[4])
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], 'address', ARGV[2], 'model_fingerprint', ARGV[3], 'epoch', e,
           'capacity_blocks', ARGV[6], 'sig', ARGV[7])
redis.call('HDEL', KEYS[2], 'kvmac', 'kvseq')
redis.call('SET', KEYS[3], e, 'PX', ARGV[4])
redis.call('DEL', KEYS[5])
redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[5], '*', 'w', ARGV[1], 'e', e, 'k', 'join')
return e
"""
# Renew only our own lease: PEXPIRE when the lease still holds our epoch.
RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
# Remove a worker of epoch ARGV[3]: only while that is still its epoch (a restarted
# worker with the same id must not be removed by its predecessor's late shutdown, nor by
# a reap decided on the older record); `reap` only when its lease is gone or no longer
# its epoch. ARGV[5]: the entry's signature ("" unsigned; prefixgate.security.identity:
# the worker's for leave, the gateways' for reap). Idempotent: a second call finds
# nothing and writes no entry.
REMOVE = """
local epoch = redis.call('HGET', KEYS[2], 'epoch')
if not epoch or redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 0 then return 0 end
if epoch ~= ARGV[3] then return 0 end
if ARGV[2] ~= 'leave' and redis.call('GET', KEYS[3]) == epoch then return 0 end
redis.call('SREM', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2], KEYS[4])
if ARGV[2] == 'leave' then redis.call('DEL', KEYS[3]) end
local entry = {'XADD', KEYS[5], 'MAXLEN', '~', ARGV[4], '*', 'w', ARGV[1], 'e', epoch,
               'k', ARGV[2]}
if ARGV[5] ~= '' then entry[#entry + 1] = 's'; entry[#entry + 1] = ARGV[5] end
redis.call(unpack(entry))
return 1
"""
# Apply one batch of ownership events, fenced by the lease's epoch, and append it to the
# stream as one entry. ARGV: id, epoch, maxlen, batch MAC, held-set MAC (in hex), the
# batch's sequence number (the last three "" when unsigned; prefixgate.security.identity), then
# (kind, parent, hashes) per event. KEYS[4]: the worker's record, which keeps the
# held-set MAC and sequence number beside pg:kv.
PUBLISH = """
local ROOT = string.rep('\\0', 8)
if redis.call('GET', KEYS[1]) ~= ARGV[2] then return 0 end
local entry = {'XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'w', ARGV[1], 'e', ARGV[2],
               'k', 'batch', 'n', tostring((#ARGV - 6) / 3)}
if ARGV[4] ~= '' then
  entry[#entry + 1] = 's'; entry[#entry + 1] = ARGV[4]
  entry[#entry + 1] = 'q'; entry[#entry + 1] = ARGV[6]
  redis.call('HSET', KEYS[4], 'kvmac', ARGV[5], 'kvseq', ARGV[6])
end
local n = 0
for i = 7, #ARGV, 3 do
  local kind, parent, hs = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if parent == '' then parent = ROOT end
  if kind == 'store' then
    for j = 1, #hs, 8 do
      local h = string.sub(hs, j, j + 7)
      redis.call('HSET', KEYS[2], h, parent)
      parent = h
    end
  elseif kind == 'remove' then
    for j = 1, #hs, 8 do redis.call('HDEL', KEYS[2], string.sub(hs, j, j + 7)) end
  else
    redis.call('DEL', KEYS[2])
  end
  entry[#entry + 1] = 'k' .. n; entry[#entry + 1] = kind
  entry[#entry + 1] = 'p' .. n; entry[#entry + 1] = ARGV[i + 1]
  entry[#entry + 1] = 'h' .. n; entry[#entry + 1] = hs
  n = n + 1
end
redis.call(unpack(entry))
return 1
"""


# A worker's whole ownership hash as one string: 16 bytes per block (hash, parent; parent
# 0 = root). Parsing 2 bulk strings per block in Python costs ~10 µs; this costs ~0.1 µs.
DUMP_KV = """
return table.concat(redis.call('HGETALL', KEYS[1]))
"""


