module @jit_s1_igrad_mb0 attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}]}}
  func.func public @main(%arg0: tensor<4x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg1: tensor<4x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg2: tensor<4x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg3: tensor<16x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) -> (tensor<4x16xf32> {jax.result_info = "result[0]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<4x16xf32> {jax.result_info = "result[1]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<4x16xf32>
    %1 = stablehlo.multiply %0, %arg2 : tensor<4x16xf32>
    %2 = stablehlo.add %0, %1 : tensor<4x16xf32>
    %3 = stablehlo.dot_general %2, %arg3, contracting_dims = [1] x [1], precision = [DEFAULT, DEFAULT] : (tensor<4x16xf32>, tensor<16x16xf32>) -> tensor<4x16xf32>
    return %3, %2 : tensor<4x16xf32>, tensor<4x16xf32>
  }
}
